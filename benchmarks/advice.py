"""Advice benchmark: does the guard's advice for the next run give a run that needs no guard?

On the demo's explosive setting (``gradguard demo``: AdamW lr 0.1, no warm-up, no clipping):

1. a guarded run writes its JSONL log; the advice is computed from that log
   (:func:`gradguard.advice.advise_from_records`, the same function as the summary's ``advice``);
2. a rerun with the advised settings and **no guard**; its final eval loss is compared with the
   demo's hand-tuned run (lr 3e-3, 30 warm-up steps, clip 1.0): it should be within 5%;
3. a rerun with the advised settings **and** the guard (clip threshold as advised): it should take
   no action.

One command (CPU, ~4-6 minutes on 2 cores; ``--steps`` shortens every run)::

    python benchmarks/advice.py [--seed 0] [--steps 250]

Writes ``benchmarks/results/advice-<date>-<machine>.{json,md}``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import asdict, replace
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from gradguard import GuardConfig  # noqa: E402
from gradguard.advice import advise_from_records  # noqa: E402
from gradguard.demo import TUNED, DemoSetting, train_run  # noqa: E402
from gradguard.demo_model import ByteBatches, load_corpus  # noqa: E402

RESULTS_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
WITHIN = 0.05


def advised_setting(base: DemoSetting, settings: dict[str, Any]) -> DemoSetting:
    """The demo setting with the advice applied (what a user would change in their script)."""
    kw: dict[str, Any] = {}
    if "lr" in settings:
        kw["lr"] = settings["lr"][0]
    elif "lr_factor" in settings:
        kw["lr"] = base.lr * settings["lr_factor"]
    for key, field in (("warmup_steps", "warmup"), ("max_grad_norm", "clip"), ("beta2", "beta2"), ("eps", "eps"),
                       ("batch_size", "batch_size")):
        if key in settings:
            kw[field] = settings[key]
    return replace(base, **kw)


def run(seed: int, steps: int | None, out: str) -> dict[str, Any]:
    kw = {"seed": seed} | ({"steps": steps} if steps else {})
    explosive = DemoSetting(**kw)
    tuned = replace(TUNED, **kw)
    data = ByteBatches(load_corpus(), explosive.seq_len)
    ev = data.eval_batches(64, 8)
    res: dict[str, Any] = {}
    cfg = GuardConfig.preset("default", output={"dir": os.path.join(out, "guarded"), "console": False})
    guarded = train_run(explosive, guard_config=cfg, out_dir=os.path.join(out, "guarded"), data=data, eval_batches=ev)
    with open(guarded["guard"]["log"], encoding="utf-8") as fh:
        advice = advise_from_records(json.loads(line) for line in fh)
    assert advice == guarded["guard"]["advice"], "the log's advice differs from the summary's"
    advised = advised_setting(explosive, advice["settings"])
    res["guarded"] = guarded
    res["advised_unguarded"] = train_run(advised, data=data, eval_batches=ev)
    gcfg = GuardConfig.preset("default", output={"dir": os.path.join(out, "advised"), "console": False},
                              clip={"max_norm": advised.clip} if advised.clip else {})
    res["advised_guarded"] = train_run(advised, guard_config=gcfg, out_dir=os.path.join(out, "advised"), data=data,
                                       eval_batches=ev)
    res["tuned"] = train_run(tuned, data=data, eval_batches=ev)
    for r in res.values():
        r.pop("losses", None)
    gap = res["advised_unguarded"]["eval_loss"] / res["tuned"]["eval_loss"] - 1
    acted = {k: v for k, v in (res["advised_guarded"]["guard"] or {}).get("actions", {}).items()}
    return {"seed": seed, "explosive": asdict(explosive), "advice": advice, "advised": asdict(advised),
            "runs": res, "gap_vs_tuned": gap, "within": abs(gap) <= WITHIN, "guard_actions_on_advised": acted,
            "no_action": not acted}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--steps", type=int, default=None, help="optimizer steps per run (default: the demo's 250)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", default=None, help="scratch folder for the event logs (default: a temp folder)")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    import tempfile

    t0 = time.time()
    with tempfile.TemporaryDirectory() as tmp:
        r = run(args.seed, args.steps, args.out or tmp)
    r["seconds"] = time.time() - t0
    os.makedirs(RESULTS_DIR, exist_ok=True)
    import platform

    tag = f"{time.strftime('%Y-%m-%d')}-cpu{os.cpu_count()}" + (f"-steps{args.steps}" if args.steps else "")
    base = os.path.join(RESULTS_DIR, f"advice-{tag}")
    r["environment"] = {"python": platform.python_version(), "torch": torch.__version__, "threads": args.threads}
    with open(base + ".json", "w", encoding="utf-8") as fh:
        json.dump(r, fh, indent=1, default=str)
    runs = r["runs"]
    lines = [f"# Advice benchmark (seed {r['seed']}, {r['explosive']['steps']} steps)", "",
             "Advice from the guarded run of the explosive setting:", ""]
    lines += [f"- {line}" for line in r["advice"]["lines"]]
    lines += ["", "| run | final eval loss | vs tuned | guard actions |", "|---|---|---|---|"]
    tuned = runs["tuned"]["eval_loss"]
    for name, rr in runs.items():
        acts = ", ".join(f"{k} x{v}" for k, v in ((rr.get("guard") or {}).get("actions") or {}).items())
        acts = acts or ("none" if rr.get("guard") else "(no guard)")
        lines.append(f"| {name} | {rr['eval_loss']:.4f} | {(rr['eval_loss'] / tuned - 1) * 100:+.1f}% | {acts} |")
    lines += ["", f"advised, no guard, within {WITHIN:.0%} of tuned: **{r['within']}** "
                  f"({r['gap_vs_tuned'] * 100:+.1f}%); guard takes no action on the advised setting: "
                  f"**{r['no_action']}**", "", f"({r['seconds']:.0f} s)"]
    with open(base + ".md", "w", encoding="utf-8") as fh:
        fh.write("\n".join(lines) + "\n")
    print("\n".join(lines))
    print(f"written: {base}.md / .json")
    return 0 if r["within"] and r["no_action"] else 1


if __name__ == "__main__":
    sys.exit(main())
