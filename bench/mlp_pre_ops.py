"""What a decode's MLP costs on the torch backend beyond its two weight products: the pre-norm and the gate
done inside the GGUF block kernels (as `TorchOps` does where those kernels were chosen) against the same
ops run in turn as torch ops (the `Ops` defaults).

    python bench/mlp_pre_ops.py [--model PATH] [--rows 1] [--rounds 40]

It loads the model (the default one unless --model) and runs every layer's `rms_norm_gated_mlp` on fresh
random rows, each way in turn, round after round, beside the two products alone (gate and up, then down,
on the same rows). It prints per layer the median time of each and the paired median of each way minus the
products, so that a busy machine disturbs all three alike.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from candelabra.backends.torch.cpu.features import cpu_flags, cpu_model_name
from candelabra.core.contract.ops import Ops
from candelabra.core.llm import LLM
from candelabra.core.text_table import format_table


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", help="a GGUF file or checkpoint folder (default: the default model)")
    parser.add_argument("--rows", type=int, default=1, help="rows of x: decoding sequences (default 1)")
    parser.add_argument("--rounds", type=int, default=40)
    args = parser.parse_args()

    llm = LLM(args.model, backend="torch")
    model, ops = llm.model, llm.model.ops
    layers = [layer for layer in model.layers if layer.mlp_in is not None and layer.experts is None]
    hidden = model.config.hidden_size
    dtype = getattr(torch, model.dtype)  # bfloat16 where the CPU has it in hardware
    x, residual = torch.randn(args.rows, hidden, dtype=dtype), torch.randn(args.rows, hidden, dtype=dtype)
    eps, before_mlp = model.config.norm_eps, model.block.before_mlp

    def products(layer):
        gated = layer.mlp_in.matmul(x)
        return layer.mlp_out.matmul(gated[:, : gated.shape[1] // 2].contiguous())

    def fused(layer):
        return ops.rms_norm_gated_mlp(x, residual, layer.norms[before_mlp].weight, eps, layer.mlp_in, layer.mlp_out)

    def in_turn(layer):
        projected, _ = Ops.rms_norm_linear(ops, x, residual, layer.norms[before_mlp].weight, eps, layer.mlp_in)
        return Ops.gated_linear(ops, projected, layer.mlp_out)

    ways = {"the two products": products, "norm and gate fused": fused, "torch ops in turn": in_turn}
    seconds = {name: [] for name in ways}
    with torch.inference_mode():
        for _ in range(args.rounds):
            for name, way in ways.items():
                start = time.perf_counter()
                for layer in layers:
                    way(layer)
                seconds[name].append((time.perf_counter() - start) / len(layers))
    llm.close()

    base = seconds["the two products"]
    print(f"{cpu_model_name()} ({'AMX' if 'amx_tile' in cpu_flags() else 'no AMX'}), {torch.get_num_threads()} "
          f"threads, {model.dtype}, {len(layers)} layers, {args.rows} row(s), medians of {args.rounds} rounds, "
          "us per layer")
    print(format_table(("way", "MLP", "above the products (paired)"), [
        (name, f"{statistics.median(times) * 1e6:.0f}",
         f"{statistics.median(t - b for t, b in zip(times, base)) * 1e6:.0f}")
        for name, times in seconds.items()]))


if __name__ == "__main__":
    main()
