"""The step ratio: a plateau signal studied for issue 26 (an LR 3-10x too high, no spike), not a rule.

    python benchmarks/step_ratio.py                                  # 4 families x 5 LRs x seeds 1, 2
    python benchmarks/step_ratio.py --models gpt --lrs 3e-3,3e-2 --seeds 1

The step ratio of a step is the loss change on the step's own batch against its first-order
prediction: ``rho = (L_b(w + d) - L_b(w)) / (g_b . d)``, with ``d`` the update the optimizer applied
and ``g_b`` the (clipped) gradient of that batch. Along the step the loss is about quadratic, so
``rho = 1 - t / (2 t*)`` for a step ``t`` against the best step ``t*`` along its direction: 1 for a
tiny step, 0.5 at the best step, 0 for a step twice too long. Unlike the signals rejected before
(the gradient/momentum cosine, the head's share, the norm share), it says which way the LR is off.
Measuring it takes a second forward pass on the step's batch after the update (here: every step).

Per (model family of ``compound.py``, LR, seed) the script trains twice, 300 steps, AdamW(0.9, 0.95),
clip 1.0, 10% warm-up then cosine: ``unguarded`` (the ratio measured, training untouched) and
``rule`` (a candidate decision: once the ratio over the last ``--window`` steps is below ``--tau``,
the LR is set to ``--cut`` x its current value for the rest of the run: the schedule's multiplier;
then ``--window`` steps of cooldown). Output: ``benchmarks/results/step-ratio.{json,md}``: the
windowed ratio by phase, both arms' eval losses, the rule's cuts.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections import deque
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import compound as C  # noqa: E402
from common import RESULTS_DIR, environment, write_results  # noqa: E402

from gradguard.demo_model import evaluate  # noqa: E402

PHASES = [(1, 10), (11, 20), (21, 30), (31, 60), (61, 100), (101, 200)]


def train(model_name: str, lr: float, seed: int, rule: dict[str, float] | None, steps: int = 300) -> dict[str, Any]:
    run = C.Run("step_ratio", model_name, seed, steps, lr)
    model, data = C.start(run)
    opt, sched = C.optimizer(run, model)  # compound.py's AdamW and warm-up + cosine
    lam = sched.lr_lambdas[0]  # set by hand below: the rule's multiplier rides on the schedule

    params = list(model.parameters())
    mult, cool, cuts = 1.0, 0, []
    window: deque[tuple[float, float]] = deque(maxlen=int(rule["window"]) if rule else 1)
    per_step: list[tuple[float, float]] = []
    for step, (x, y) in enumerate(C.batches(run, data), 1):
        now = lr * lam(step - 1) * mult
        for g in opt.param_groups:
            g["lr"] = now
        loss = model(x, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        old = [p.detach().clone() for p in params]
        opt.step()
        with torch.no_grad():
            gd = sum((p.grad * (p - o)).sum() for p, o in zip(params, old)).item()
            after = model(x, y).item()  # the same batch on the updated weights
        opt.zero_grad(set_to_none=True)
        per_step.append((after - loss.item(), gd))
        window.append(per_step[-1])
        if rule and step >= rule["start"] and len(window) == window.maxlen and step >= cool:
            rho = sum(w[0] for w in window) / sum(w[1] for w in window)
            if rho < rule["tau"]:
                mult = now * rule["cut"] / lr
                cuts.append([step, round(rho, 3), now * rule["cut"]])
                window.clear()
                cool = step + window.maxlen
    phases = [sum(d for d, _ in per_step[a - 1:b]) / sum(g for _, g in per_step[a - 1:b]) if a <= steps else None
              for a, b in PHASES]
    return {"eval": evaluate(model, C.eval_batches(data)), "phases": phases, "cuts": cuts}


def markdown(doc: dict[str, Any]) -> str:
    rule = doc["rule"]
    head = " | ".join(f"{a}-{b}" for a, b in PHASES)
    gg = any("gradguard" in r for r in doc["rows"])
    lines = [f"# Step ratio (issue 26 study), {doc['steps']} steps",
             "",
             f"Rule arm: ratio over {rule['window']} steps below {rule['tau']} (from step {rule['start']}) -> LR x "
             f"{rule['cut']}. Ratio: (loss on the step's batch after the update - before) / (g . d), by phase "
             "(steps) of the unguarded run.",
             "",
             f"| model | lr | seed | {head} | unguarded | rule | rule / unguarded | cuts (step, ratio, new LR) |"
             + (" gradguard / unguarded | gradguard's actions |" if gg else ""),
             "|---|---|---|" + "---|" * len(PHASES) + "---|---|---|---|" + ("---|---|" if gg else "")]
    for r in doc["rows"]:
        u, g = r["unguarded"], r["rule"]
        ratios = " | ".join("-" if v is None else f"{v:.2f}" for v in u["phases"])
        lines.append(f"| {r['model']} | {r['lr']:g} | {r['seed']} | {ratios}"
                     + f" | {u['eval']:.3f} | {g['eval']:.3f} | {g['eval'] / u['eval']:.3f} | "
                     + (", ".join(f"({c[0]}, {c[1]}, {c[2]:.2g})" for c in g["cuts"]) or "-") + " |"
                     + (f" {r['gradguard']['eval'] / u['eval']:.3f} | "
                        + (", ".join(f"{k} {v}" for k, v in r["gradguard"]["actions"].items()) or "-") + " |"
                        if "gradguard" in r else ""))
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default="gpt,llama,postln,conv")
    ap.add_argument("--lrs", default="1e-3,3e-3,1e-2,3e-2,1e-1")
    ap.add_argument("--seeds", default="1,2")
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--tau", type=float, default=0.4)
    ap.add_argument("--window", type=int, default=20)
    ap.add_argument("--cut", type=float, default=0.5)
    ap.add_argument("--start", type=int, default=5)
    ap.add_argument("--gradguard", action="store_true",
                    help="also train gradguard (defaults, compound.py's plain loop: its default clip 1.0)")
    ap.add_argument("--tag", default="")
    args = ap.parse_args(argv)
    rule = {"tau": args.tau, "window": args.window, "cut": args.cut, "start": args.start}
    rows, t0 = [], time.time()
    for model in args.models.split(","):
        for lr in (float(v) for v in args.lrs.split(",")):
            for seed in (int(v) for v in args.seeds.split(",")):
                row = {"model": model, "lr": lr, "seed": seed,
                       "unguarded": train(model, lr, seed, None, args.steps),
                       "rule": train(model, lr, seed, rule, args.steps)}
                if args.gradguard:
                    g = C.train(C.Run("step_ratio", model, seed, args.steps, lr), "gradguard")
                    row["gradguard"] = {"eval": g["eval"], "actions": g["actions"]}
                rows.append(row)
                gg = row.get("gradguard", {}).get("eval", float("nan"))
                print(f"{model} {lr:g} seed {seed}: unguarded {row['unguarded']['eval']:.3f} rule "
                      f"{row['rule']['eval']:.3f} gradguard {gg:.3f} cuts {row['rule']['cuts']} "
                      f"({time.time() - t0:.0f}s)", flush=True)
    doc = {"steps": args.steps, "rule": rule, "rows": rows, "environment": environment(),
           "seconds": round(time.time() - t0)}
    write_results(os.path.join(RESULTS_DIR, f"step-ratio{args.tag}"), doc, markdown(doc))
    print(markdown(doc))
    return doc


if __name__ == "__main__":
    main()
