"""KV cache bytes per token of each model in bench/configs (or the config.json files given), as
candelabra keeps the cache, and for a model with latent attention also as the per-head keys and values
that a cache of the expanded form (transformers' DeepseekV2/V3) holds; and how many tokens fit in a
budget of cache memory each way.

    python bench/kv_cache_bytes.py [CONFIG ...] [--dtype bfloat16] [--budget-gib 8]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from candelabra.core.contract.kv_cache import BYTES_PER_ELEMENT, KVCacheSpec
from candelabra.core.models.config import ModelConfig
from candelabra.core.text_table import format_table
from candelabra.plugins import installed_plugins

CONFIGS = Path(__file__).parent / "configs"


def kv_bytes_per_token(config: ModelConfig, dtype: str) -> tuple[int, int | None]:
    """(bytes per token as candelabra caches it, bytes per token expanded per head; None for a model
    without latent attention, whose cache is already per head)."""
    family = installed_plugins().model_architectures.get(config.architecture)
    kv_heads, key_width, value_width = family.kv_cache_layout(config, config.num_kv_heads)
    kept = KVCacheSpec(config.num_layers, 1, 1, kv_heads, key_width, dtype, value_width).bytes_per_token
    if config.mla is None:
        return kept, None
    per_head = config.mla.qk_head_dim + config.mla.v_head_dim
    return kept, config.num_layers * config.num_heads * per_head * BYTES_PER_ELEMENT[dtype]


def rows(paths: list[Path], dtype: str, budget_gib: float) -> list[tuple[str, ...]]:
    budget = budget_gib * 2**30
    table = []
    for path in paths:
        config = ModelConfig.from_hf(json.loads(path.read_text(encoding="utf-8")))
        kept, expanded = kv_bytes_per_token(config, dtype)
        table.append((path.parent.name, config.architecture, f"{kept:,}", f"{int(budget // kept):,}",
                      "-" if expanded is None else f"{expanded:,}",
                      "-" if expanded is None else f"{int(budget // expanded):,}",
                      "-" if expanded is None else f"{expanded / kept:.1f}x"))
    return table


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("configs", nargs="*", type=Path, help="config.json files (default: bench/configs/*)")
    parser.add_argument("--dtype", default="bfloat16", choices=sorted(BYTES_PER_ELEMENT))
    parser.add_argument("--budget-gib", type=float, default=8.0, help="cache memory for the tokens-that-fit columns")
    args = parser.parse_args(argv)
    paths = args.configs or sorted(CONFIGS.glob("*/config.json"))
    print(format_table(("model", "architecture", "bytes/token", f"tokens in {args.budget_gib:g} GiB",
                        "expanded bytes/token", "tokens expanded", "saved"), rows(paths, args.dtype, args.budget_gib)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
