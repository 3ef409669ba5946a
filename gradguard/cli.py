"""The ``gradguard`` command."""

from __future__ import annotations

import argparse
import json
import sys


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="gradguard", description="Keeps neural-network training from blowing up.")
    from .names import VERSION

    parser.add_argument("--version", action="version", version=f"gradguard {VERSION}")
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="train a tiny GPT with an explosive setting, unguarded vs guarded vs hand-tuned (CPU; about 4 min on 2 cores, measured)")
    demo.add_argument("--out", default=None, help="folder for the JSONL event log and summary.json (default ./gradguard_demo)")
    demo.add_argument("--steps", type=int, default=None, help="optimizer steps per run (default 250)")
    demo.add_argument("--seed", type=int, default=0, help="seed (default 0)")
    demo.add_argument("--quiet", action="store_true", help="print only the table")
    rep = sub.add_parser("report", help="an HTML report from a run's JSONL event log (opens offline)")
    rep.add_argument("run_dir", metavar="RUN_DIR", help="the guard's output folder, or the events.jsonl itself")
    rep.add_argument("-o", "--output", default=None, help="the HTML file (default: report.html next to the log)")
    rep.add_argument("--plotlyjs", choices=["directory", "inline", "cdn"], default="directory",
                     help="plotly.js: 'directory' (default) writes plotly.min.js once next to the report (offline "
                          "while the two stay together); 'inline' embeds it (one ~5 MB file, offline anywhere); "
                          "'cdn' loads it from the network (smallest)")
    dash = sub.add_parser("dashboard", help="create a ready 'training stability' dashboard")
    dash.add_argument("kind", choices=["wandb"], help="where (W&B workspace; TensorBoard gets its layout from the sink)")
    dash.add_argument("--entity", default=None, help="W&B entity (team or user)")
    dash.add_argument("--project", default=None, help="W&B project")
    dash.add_argument("--prefix", default="", help="key prefix the engine adds (HF report_to: 'train/')")
    dash.add_argument("--dry-run", action="store_true", help="write the workspace spec as JSON; no server, no login")
    dash.add_argument("-o", "--output", default=None, help="the spec file for --dry-run (default: stdout)")
    return parser


def _dashboard(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    from .dashboards import create_wandb_workspace, wandb_workspace_spec

    if args.dry_run:
        spec = json.dumps(wandb_workspace_spec(entity=args.entity or "ENTITY", project=args.project or "PROJECT",
                                               prefix=args.prefix), indent=1)
        if args.output:
            with open(args.output, "w", encoding="utf-8") as fh:
                fh.write(spec + "\n")
            print(args.output)
        else:
            print(spec)
        return 0
    if not args.entity or not args.project:
        parser.error("dashboard wandb: --entity and --project are needed to create the workspace "
                     "(or --dry-run to write its spec)")
    print(create_wandb_workspace(entity=args.entity, project=args.project, prefix=args.prefix))
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    if args.command == "report":
        from .errors import ConfigError
        from .report import write_report

        try:
            print(write_report(args.run_dir, args.output, plotlyjs=args.plotlyjs))
        except (ConfigError, ImportError) as exc:
            parser.exit(2, f"{exc}\n")
        return 0
    if args.command == "dashboard":
        return _dashboard(args, parser)
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
