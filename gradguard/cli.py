"""The ``gradguard`` command."""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="gradguard", description="Keeps neural-network training from blowing up.")
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="train a tiny GPT with an explosive setting, unguarded vs guarded (CPU, ~2 min)")
    demo.add_argument("--out", default=None, help="folder for the JSONL event log and summary.json (default ./gradguard_demo)")
    demo.add_argument("--steps", type=int, default=None, help="optimizer steps per run (default 250)")
    demo.add_argument("--seed", type=int, default=0, help="seed (default 0)")
    demo.add_argument("--quiet", action="store_true", help="print only the table")
    args = parser.parse_args(argv)
    if args.command == "demo":
        from .demo import format_table
        from .demo import main as run_demo

        if args.steps is not None and args.steps < 10:
            parser.error(f"--steps={args.steps}: too few to show anything; use at least 10 (default 250)")
        runs = run_demo(out=args.out, steps=args.steps, seed=args.seed, quiet=args.quiet)
        if args.quiet:
            print(format_table(runs))
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
