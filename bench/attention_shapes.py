"""What the attention benches on a GPU share: the attention shape they take on the command line (Llama-3-8B's
by default) and the refusal to run where torch sees no GPU."""

from __future__ import annotations

import argparse

import torch


def add_attention_shape(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--heads", type=int, nargs=2, default=[32, 8], metavar=("QUERY", "KV"))
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"])


def parse_on_gpu(parser: argparse.ArgumentParser) -> argparse.Namespace:
    """The parsed arguments, or the parser's error where torch sees no GPU to measure."""
    args = parser.parse_args()
    if not torch.cuda.is_available():
        parser.error("this measures a GPU: torch sees none")
    return args
