"""``python -m cai_streams demo``: a short run that shows what the library does."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from ._demo import run_demo


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m cai_streams")
    commands = parser.add_subparsers(dest="command", required=True)
    demo = commands.add_parser(
        "demo", help="run a data-loading pipeline (copy, preprocess, async consume) and report it"
    )
    demo.add_argument("--backend", choices=("sim", "cuda"), default=None)
    demo.add_argument("--batches", type=int, default=64, help="batches to run (default 64)")
    demo.add_argument("--buffers", type=int, default=4, help="device buffers in the ring")
    demo.add_argument("--seed", type=int, default=None, help="simulated device jitter seed")
    demo.add_argument("--trace", metavar="FILE", help="write a Chrome/Perfetto trace (JSON)")
    demo.add_argument("--plot", metavar="FILE.png", help="draw the stream timeline (matplotlib)")
    args = parser.parse_args(argv)
    if args.batches < 1:
        parser.error("--batches must be at least 1")
    if args.buffers < 1:
        parser.error("--buffers must be at least 1")
    return run_demo(backend=args.backend, batches=args.batches, buffers=args.buffers,
                    seed=args.seed, trace_path=args.trace, plot_path=args.plot)  # fmt: skip


if __name__ == "__main__":
    sys.exit(main())
