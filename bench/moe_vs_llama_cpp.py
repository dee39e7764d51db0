"""A mixture-of-experts model served by `candelabra serve` (torch backend) and by llama.cpp's llama-server,
from one GGUF file, under the same load: decode tokens/s at 1, 16 and 64 clients, in one command.

    python bench/moe_vs_llama_cpp.py --llama-server PATH [--config bench/moe-small/config.json]
                                     [--type Q8_0] [--threads 2] [--clients 1 16 64] [--output-len 64]

The model is `--load-format dummy`'s random weights for the config.json (a Qwen3-MoE: 8 layers of 32
experts, 8 a token, by default, about 0.6B parameters of which 0.2B run per token), written as llama.cpp's
converter writes a qwen3moe GGUF (experts stacked 3-D, 2-D weights and experts in --type, routers and
norms float32) with the default model's tokenizer, cached beside the config. llama-server runs with 16
slots and --threads; then bench/serve_vs_peer.py starts candelabra on the same file and measures both.
"""

from __future__ import annotations

import argparse
import importlib.util
import platform
import re
import subprocess
import sys
import time
from pathlib import Path

import gguf
import httpx
import numpy as np

from candelabra.conformance.gguf_models import encoded, write_gguf
from candelabra.core.loading.dummy import DummyCheckpoint
from candelabra.core.models.config import ModelConfig
from candelabra.core.weights.default_model import default_model_path

BENCH = Path(__file__).parent
DEFAULT_CONFIG = BENCH / "moe-small" / "config.json"
EXPERT = re.compile(r"model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight")
STACKED = {"gate_proj": gguf.MODEL_TENSOR.FFN_GATE_EXP, "up_proj": gguf.MODEL_TENSOR.FFN_UP_EXP,
           "down_proj": gguf.MODEL_TENSOR.FFN_DOWN_EXP}
ROUTER = "ffn_gate_inp"


def qwen3moe_metadata(config: ModelConfig) -> dict:
    moe, a = config.moe, "qwen3moe"
    return {
        f"{a}.context_length": config.max_position_embeddings,
        f"{a}.embedding_length": config.hidden_size,
        f"{a}.block_count": config.num_layers,
        f"{a}.feed_forward_length": config.intermediate_size,
        f"{a}.expert_feed_forward_length": moe.expert_intermediate_size,
        f"{a}.expert_count": moe.num_experts,
        f"{a}.expert_used_count": moe.experts_per_token,
        f"{a}.attention.head_count": config.num_heads,
        f"{a}.attention.head_count_kv": config.num_kv_heads,
        f"{a}.attention.key_length": config.head_dim,
        f"{a}.attention.value_length": config.head_dim,
        f"{a}.attention.layer_norm_rms_epsilon": config.norm_eps,
        f"{a}.rope.freq_base": config.rope.theta,
    }


def tokenizer_metadata(path: Path) -> dict:
    """Every tokenizer.* key of a GGUF file, as write_gguf takes them."""
    reader = gguf.GGUFReader(path)
    return {name: field.contents() for name, field in reader.fields.items() if name.startswith("tokenizer.")}


def write_dummy_gguf(config_file: Path, path: Path, ggml_type: gguf.GGMLQuantizationType, tokenizer: dict) -> Path:
    """`--load-format dummy`'s weights for `config_file` as a qwen3moe GGUF file at `path`, with the
    `tokenizer.*` metadata `tokenizer`."""
    checkpoint = DummyCheckpoint(config_file)
    config = ModelConfig.from_hf(checkpoint.config)
    if config.architecture != "Qwen3MoeForCausalLM":
        raise SystemExit(f"{config_file}: a {config.architecture}; this benchmark writes Qwen3-MoE GGUF files only")
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.QWEN3MOE, config.num_layers)
    tensors, experts = {}, {}
    for name in checkpoint.tensor_names():
        data = checkpoint.load(name).astype(np.float32)
        expert = EXPERT.fullmatch(name)
        if expert is not None:
            layer, index, projection = int(expert.group(1)), int(expert.group(2)), expert.group(3)
            experts.setdefault((layer, projection), {})[index] = data
            continue
        module, suffix = name.rsplit(".", 1)
        tensors[f"{names.get_name(module)}.{suffix}"] = data
    for (layer, projection), by_index in experts.items():
        stacked = np.stack([by_index[index] for index in sorted(by_index)])
        tensors[f"{gguf.TENSOR_NAMES[STACKED[projection]].format(bid=layer)}.weight"] = stacked
    stored = {name: encoded(data, ggml_type) if data.ndim >= 2 and ROUTER not in name else data
              for name, data in tensors.items()}
    return write_gguf(path, "qwen3moe", qwen3moe_metadata(config) | tokenizer, stored)


def start_llama_server(binary: str, model: Path, port: int, threads: int) -> subprocess.Popen:
    process = subprocess.Popen([binary, "-m", str(model), "-np", "16", "-t", str(threads), "-c", "8192",
                                "--port", str(port), "--host", "127.0.0.1"],
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise SystemExit(f"llama-server exited with {process.returncode} while loading {model}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return process
        except httpx.HTTPError:
            pass
        time.sleep(1)
    process.kill()
    raise SystemExit("llama-server did not become healthy in 300 s")


def serve_vs_peer():
    spec = importlib.util.spec_from_file_location("serve_vs_peer", BENCH / "serve_vs_peer.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def cpu_name() -> str:
    """lscpu's model name, with the family and model numbers and whether it has AMX."""
    fields = {}
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        key, _, value = line.partition(":")
        fields.setdefault(key.strip(), value.strip())
    if "model name" not in fields:
        return platform.processor() or "unknown CPU"
    amx = "AMX" if "amx_tile" in fields.get("flags", "").split() else "no AMX"
    return f"{fields['model name']} (family {fields.get('cpu family')}, model {fields.get('model')}; {amx})"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--llama-server", required=True, help="llama.cpp's llama-server binary")
    parser.add_argument("--config", type=Path, default=DEFAULT_CONFIG, help="a Qwen3-MoE config.json")
    parser.add_argument("--type", default="Q8_0", choices=["F16", "Q8_0", "Q4_0"], help="the GGUF's weight type")
    parser.add_argument("--threads", type=int, default=2, help="llama-server's threads (default: %(default)s)")
    parser.add_argument("--port", type=int, default=8090, help="llama-server's port (default: %(default)s)")
    parser.add_argument("--clients", nargs="+", default=["1", "16", "64"])
    parser.add_argument("--output-len", default="64")
    parser.add_argument("--json", help="also write every number as JSON")
    args = parser.parse_args(argv)
    ggml_type = gguf.GGMLQuantizationType[args.type]
    model = args.config.parent / f"{args.config.parent.name}-{args.type.lower()}.gguf"
    if not model.exists():
        started = time.monotonic()
        write_dummy_gguf(args.config, model, ggml_type, tokenizer_metadata(default_model_path()))
        print(f"wrote {model} ({model.stat().st_size / 2**20:.0f} MiB) in {time.monotonic() - started:.0f} s")
    print(f"CPU: {cpu_name()}")
    peer = start_llama_server(args.llama_server, model, args.port, args.threads)
    try:
        options = ["--model", str(model), "--backend", "torch", "--peer-url", f"http://127.0.0.1:{args.port}",
                   "--peer-name", "llama.cpp", "--peer-pid", str(peer.pid), "--clients", *args.clients,
                   "--output-len", args.output_len]
        return serve_vs_peer().main(options + (["--json", args.json] if args.json else []))
    finally:
        peer.terminate()
        peer.wait(timeout=30)


if __name__ == "__main__":
    sys.exit(main())
