"""`candelabra conformance`: the shared suite on one backend, level by level."""

from __future__ import annotations

import argparse
import sys


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from candelabra.conformance import LEVELS, OPT_IN_LEVELS
    from candelabra.conformance.op_cases import op_names

    parser.add_argument("--backend", help="a registered backend name, or package.module:Class")
    parser.add_argument("--level", action="append", choices=LEVELS + OPT_IN_LEVELS,
                        help="suite level (default: ops, models and engine; parallel, which starts a process "
                             "per rank, only when named)")
    parser.add_argument("--op", action="append", default=[],
                        help=f"only this op's cases (repeatable): {', '.join(op_names())}")
    parser.add_argument("--list-ops", action="store_true",
                        help="print the ops level's op names, each with the contract call it checks, and exit")
    parser.add_argument("--thresholds", action="store_true",
                        help="print the error limits per op and dtype, and what each rests on, and exit")
    parser.add_argument("--json", metavar="FILE", help="also write the results as JSON")
    parser.add_argument("--seed", type=int, help="base seed of the random inputs, to repeat a run")
    parser.add_argument("--dtype", choices=("float32", "float16", "bfloat16"),
                        help="compute dtype of the models and engine levels (default: float32); "
                             "the ops level always runs every dtype the backend declares")
    parser.add_argument("pytest_args", nargs="*", help="passed on to pytest after --, e.g. -- -x -v")


def run(args: argparse.Namespace) -> int:
    from candelabra.conformance import LEVELS
    from candelabra.conformance.runner import run

    if args.thresholds:
        from candelabra.conformance.thresholds import threshold_table

        print(threshold_table())
        return 0
    if args.list_ops:
        from candelabra.conformance.op_cases import op_listing

        print(op_listing())
        return 0
    if args.backend is None:
        print("error: --backend is required (a registered backend name, or package.module:Class)", file=sys.stderr)
        return 2

    return run(args.backend, levels=args.level or LEVELS, ops=args.op, json_path=args.json, seed=args.seed,
               dtype=args.dtype, pytest_args=args.pytest_args)
