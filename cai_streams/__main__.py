"""``python -m cai_streams demo``: a short run that shows what the library does."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from ._demo import run_demo


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m cai_streams")
    commands = parser.add_subparsers(dest="command", required=True)
    demo = commands.add_parser("demo", help="run a short multi-stream handoff and report it")
    demo.add_argument("--backend", choices=("sim", "cuda"), default=None)
    demo.add_argument("--rounds", type=int, default=20, help="handoffs to run (default 20)")
    demo.add_argument("--seed", type=int, default=None, help="simulated device jitter seed")
    args = parser.parse_args(argv)
    if args.rounds < 1:
        parser.error("--rounds must be at least 1")
    return run_demo(backend=args.backend, rounds=args.rounds, seed=args.seed)


if __name__ == "__main__":
    sys.exit(main())
