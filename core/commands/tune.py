"""`candelabra tune --backend NAME`: measure the backend's kernels on this machine and write the table its
serve then reads here (Backend.tune_kernels). Run it on a quiet machine: other processes' load slows
some kernels more than others."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--backend", required=True, help="the backend whose kernels to measure (e.g. torch)")
    parser.add_argument("--dtype", action="append", dest="dtypes", metavar="DTYPE",
                        help="a compute dtype to measure, repeatable (default: the backend's default here)")
    parser.add_argument("--format", action="append", dest="formats", metavar="FORMAT",
                        help="a weight format to measure, repeatable (default: every format the backend keeps)")
    parser.add_argument("--shape", action="append", dest="shapes", type=_shape, metavar="NxK",
                        help="a weight shape (output x input features) to measure at, repeatable "
                             "(default: the backend's, a small model's)")
    parser.add_argument("--output", type=Path,
                        help="write the table here instead of where serve reads it on this machine")


def run(args: argparse.Namespace) -> int:
    from candelabra.plugins import choose_backend

    try:
        backend = choose_backend(args.backend)
        print(backend.tune_kernels(args.dtypes, args.formats, args.shapes, args.output,
                                   progress=lambda what: print(f"measuring {what}", file=sys.stderr, flush=True)))
    except (LookupError, ValueError, RuntimeError, NotImplementedError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    return 0


def _shape(text: str) -> tuple[int, int]:
    rows, _, columns = text.lower().partition("x")
    try:
        shape = (int(rows), int(columns))
    except ValueError:
        shape = (0, 0)
    if min(shape) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: give a weight shape as NxK, e.g. 4864x1024")
    return shape
