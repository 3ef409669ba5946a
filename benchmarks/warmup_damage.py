"""Where the 3x plateau is made: a study for issue 26 (an LR 3-10x too high, no spike), not a rule.

    python benchmarks/warmup_damage.py                      # 4 families x (best LR, 3x) x seeds 1, 2
    python benchmarks/warmup_damage.py --models gpt --lrs 1e-2 --seeds 1

Every plateau signal studied so far (a takeover, the step ratio, ...) is read after the warm-up.
This asks whether an LR cut there can still help, and if not, when and where the loss is lost.
Per (model family of ``compound.py``, LR, seed), 300 steps, AdamW(0.9, 0.95), clip 1.0, 10% warm-up
then cosine, the arms are:

- ``unguarded``: the run as it is; its largest attention logit and the growth of each head's
  ``||W_q^T W_k||`` over its initial value (``nn.MultiheadAttention`` families) are read at the steps
  in ``--logit-at``;
- ``cut@k`` for k in ``--cut-at``: the same run, and from step k on the LR times ``--factor`` (the
  schedule scaled: a perfect detector firing at step k, no rollback). With each, the probe gain:
  the relative lead of the cut branch over the unguarded one on ``--probe-batches`` held-out
  batches, 20 and 40 steps after the cut (a causal A/B probe: what a guard could measure);
- ``rollback``: a detector firing at step ``--rollback-from`` (after the warm-up) that rolls back to
  the first ``--cut-at`` step and goes on at ``--factor`` x the LR: the steps in between are lost,
  as in a guard's rollback (the batch stream and the schedule go on);
- ``attn x f``: the attention input projections (``in_proj``) alone at ``--factor`` x the LR from
  the first step, everything else as unguarded: does the damage sit in attention?
- ``attn x f past G``: the same from the step the product ||W_q||_F ||W_k||_F of some attention
  first grows past ``G`` x its initial value (``--triggers``): a trigger read from the weights
  alone, with a remedy whose false alarm is cheap (the attention arm costs little at the best LR).

Output: ``benchmarks/results/warmup-damage.{json,md}``.
"""

from __future__ import annotations

import argparse
import copy
import math
import os
import sys
import time
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import compound as C  # noqa: E402
from common import RESULTS_DIR, environment, write_results  # noqa: E402

from gradguard.demo_model import evaluate  # noqa: E402

PROBE_AFTER = (20, 40)


def _attention(model: torch.nn.Module) -> list[torch.nn.MultiheadAttention]:
    return [m for m in model.modules() if isinstance(m, torch.nn.MultiheadAttention)]


def max_attention_logit(model: torch.nn.Module, x: torch.Tensor) -> float | None:
    """The largest |q.k| / sqrt(d_head) over every ``nn.MultiheadAttention`` of ``model`` on ``x`` and
    every query-key pair (the causal mask not applied: the scale of the bilinear form); None without one."""
    mods = _attention(model)
    if not mods:
        return None
    seen: dict[int, torch.Tensor] = {}
    hooks = [m.register_forward_pre_hook(lambda mod, args, i=i: seen.__setitem__(i, args[0].detach()))
             for i, m in enumerate(mods)]
    try:
        with torch.no_grad():
            model(x)
            top = 0.0
            for i, m in enumerate(mods):
                e, h = m.embed_dim, m.num_heads
                w, b = m.in_proj_weight, m.in_proj_bias
                q = seen[i] @ w[:e].T + (0 if b is None else b[:e])
                k = seen[i] @ w[e:2 * e].T + (0 if b is None else b[e:2 * e])
                q = q.unflatten(-1, (h, e // h)).transpose(1, 2)
                k = k.unflatten(-1, (h, e // h)).transpose(1, 2)
                top = max(top, float((q @ k.transpose(-1, -2)).abs().amax()) / math.sqrt(e // h))
    finally:
        for hk in hooks:
            hk.remove()
    return top


def qk_gain(model: torch.nn.Module) -> list[float]:
    """Per head of every ``nn.MultiheadAttention``: the spectral norm of W_q^T W_k (the bilinear form
    the attention logits come from), read from the weights alone."""
    out = []
    with torch.no_grad():
        for m in _attention(model):
            e, h = m.embed_dim, m.num_heads
            d = e // h
            w = m.in_proj_weight
            for j in range(h):
                out.append(float(torch.linalg.matrix_norm(w[j * d:(j + 1) * d].T @ w[e + j * d:e + (j + 1) * d], 2)))
    return out


def qk_frobenius(model: torch.nn.Module) -> list[float]:
    """Per ``nn.MultiheadAttention``: ||W_q||_F * ||W_k||_F, a bound on every head's logit scale that
    needs neither the head count nor a forward pass."""
    with torch.no_grad():
        return [float(m.in_proj_weight[:m.embed_dim].norm() * m.in_proj_weight[m.embed_dim:2 * m.embed_dim].norm())
                for m in _attention(model)]


def study(model_name: str, lr: float, seed: int, steps: int, cut_at: list[int], factor: float, n_probe: int,
          logit_at: list[int], rollback_from: int | None = None, triggers: tuple[float, ...] = ()) -> dict[str, Any]:
    run = C.Run("warmup_damage", model_name, seed, steps, lr)
    model, data = C.start(run)
    _, sched = C.optimizer(run, model)
    lam = sched.lr_lambdas[0]
    stream = list(C.batches(run, data))
    pg = torch.Generator().manual_seed(70_000 + seed)  # held out: a stream no step trains on
    probe = [data.train_batch(C.BATCH, pg) for _ in range(n_probe)]
    attn = [p for n, p in model.named_parameters() if "in_proj" in n]
    ids = {id(p) for p in attn}
    # compound.py's AdamW, the attention projections in a group of their own (bitwise the same run)
    opt = torch.optim.AdamW([{"params": [p for p in model.parameters() if id(p) not in ids], "m": 1.0},
                             {"params": attn, "m": 1.0}], lr=lr, betas=(0.9, 0.95), weight_decay=0.01)

    def step(i: int, mult: float) -> None:
        for g in opt.param_groups:
            g["lr"] = lr * lam(i - 1) * mult * g["m"]
        x, y = stream[i - 1]
        model(x, y).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)

    def snapshot() -> tuple[Any, Any]:
        return copy.deepcopy(model.state_dict()), copy.deepcopy(opt.state_dict())

    def restore(snap: tuple[Any, Any]) -> None:
        model.load_state_dict(snap[0])
        opt.load_state_dict(snap[1])

    start = snapshot()
    snaps: dict[int, tuple[Any, Any]] = {}
    probe_at = {k + d for k in cut_at for d in PROBE_AFTER}
    unguarded: dict[str, Any] = {"probe": {}, "logit": {}, "qk_growth": {}}
    qk0 = qk_gain(model)
    f0 = qk_frobenius(model)
    crossed: dict[float, tuple[int, tuple[Any, Any]]] = {}  # growth line -> (step, snapshot) when crossed
    for i in range(1, steps + 1):
        if i - 1 in cut_at:
            snaps[i - 1] = snapshot()
        step(i, 1.0)
        if f0 and any(g not in crossed for g in triggers):
            growth = max(a / b for a, b in zip(qk_frobenius(model), f0))
            for g in triggers:
                if g not in crossed and growth > g:
                    crossed[g] = (i, snapshot())
        if i in probe_at:
            unguarded["probe"][i] = evaluate(model, probe)
        if i in logit_at:
            unguarded["logit"][i] = max_attention_logit(model, probe[0][0])
            if qk0:
                unguarded["qk_growth"][i] = max(a / b for a, b in zip(qk_gain(model), qk0))
    unguarded["eval"] = evaluate(model, C.eval_batches(data))
    out: dict[str, Any] = {"unguarded": unguarded, "cuts": {}}
    for k in cut_at:
        restore(snaps[k])
        gain = {}
        for i in range(k + 1, steps + 1):
            step(i, factor)
            if i - k in PROBE_AFTER:
                gain[i - k] = (unguarded["probe"][i] - evaluate(model, probe)) / unguarded["probe"][i]
        out["cuts"][k] = {"eval": evaluate(model, C.eval_batches(data)), "gain": gain}
    if rollback_from is not None and rollback_from < steps:
        k = min(cut_at)  # a detector firing at step rollback_from: back to step k, steps k+1..from are lost
        restore(snaps[k])
        for i in range(rollback_from + 1, steps + 1):
            step(i, factor)
        out["rollback"] = {"from": rollback_from, "to": k, "eval": evaluate(model, C.eval_batches(data))}
    if attn:  # the attention projections at factor x the LR: from the first step, or once a growth line is crossed
        arms = [("attn", 0, start)] + [(g, *c) for g, c in sorted(crossed.items())]
        out["trigger"] = {}
        for name, at_step, snap in arms:
            restore(snap)
            opt.param_groups[1]["m"] = factor
            for i in range(at_step + 1, steps + 1):
                step(i, 1.0)
            ev = evaluate(model, C.eval_batches(data))
            if name == "attn":
                out["attn"] = ev
            else:
                out["trigger"][name] = {"step": at_step, "eval": ev}
    return out


def markdown(doc: dict[str, Any]) -> str:
    cut_at, f = doc["cut_at"], doc["factor"]
    lines = [f"# Warm-up damage (issue 26 study), {doc['steps']} steps, warm-up {doc['steps'] // 10} steps, "
             f"cut = LR x{f:.2g} from step k",
             "",
             "Final eval loss per arm; in brackets the probe gain of the cut branch over the unguarded one on "
             "held-out batches, 20 / 40 steps after the cut (positive: the cut branch is ahead). "
             "max attn logit: the unguarded run's largest |q.k|/sqrt(d_head) (any query-key pair) at the steps shown; W_q^T W_k growth: "
             "the largest growth of a head's ||W_q^T W_k||_2 over its value at initialisation (weights only).",
             "",
             "| model | lr | seed | unguarded | " + " | ".join(f"cut@{k}" for k in cut_at)
             + " | rollback |" + f" attn x{f:.2g} | max attn logit ({', '.join(str(s) for s in doc['logit_at'])})"
             + " | W_q^T W_k growth since init (same steps) |"
             + "".join(f" attn x{f:.2g} past {g:g}x (step) |" for g in doc.get("triggers", [])),
             "|---|---|---|---|" + "---|" * len(cut_at) + "---|---|---|---|" + "---|" * len(doc.get("triggers", []))]
    for r in doc["rows"]:
        o = r["out"]
        cuts = []
        for k in cut_at:
            c = o["cuts"][str(k)] if str(k) in o["cuts"] else o["cuts"][k]
            g = {int(n): v for n, v in c["gain"].items()}
            cuts.append(f"{c['eval']:.3f} ({' / '.join(f'{100 * g[n]:+.1f}%' for n in PROBE_AFTER if n in g)})")
        logits = ", ".join("-" if v is None else f"{v:.0f}" for v in o["unguarded"]["logit"].values()) or "-"
        attn = f"{o['attn']:.3f}" if "attn" in o else "-"
        back = f"{o['rollback']['eval']:.3f} ({o['rollback']['from']} -> {o['rollback']['to']})" if "rollback" in o else "-"
        growth = ", ".join(f"{v:.1f}x" for v in o["unguarded"].get("qk_growth", {}).values()) or "-"
        fired = {float(g): t for g, t in o.get("trigger", {}).items()}
        trig = "".join(f" {fired[g]['eval']:.3f} ({fired[g]['step']}) |" if g in fired else " - |"
                       for g in doc.get("triggers", []))
        lines.append(f"| {r['model']} | {r['lr']:g} | {r['seed']} | {o['unguarded']['eval']:.3f} | "
                     + " | ".join(cuts) + f" | {back} | {attn} | {logits} | {growth} |" + trig)
    return "\n".join(lines) + "\n"


#: each family's best LR of the step-ratio sweep and 3x it
DEFAULT_LRS = {"gpt": "3e-3,1e-2", "llama": "3e-3,1e-2", "postln": "1e-2,3e-2", "conv": "1e-2,3e-2"}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default="gpt,llama,postln,conv")
    ap.add_argument("--lrs", default=None, help="default: each family's best LR and 3x it")
    ap.add_argument("--seeds", default="1,2")
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--factor", type=float, default=1 / 3)
    ap.add_argument("--cut-at", default="10,20,30")
    ap.add_argument("--logit-at", default="10,30,60")
    ap.add_argument("--rollback-from", type=int, default=40)
    ap.add_argument("--triggers", default="1.1,1.2,1.3,1.5",
                    help="growth lines of ||W_q||_F ||W_k||_F: the attention arm from the step one is crossed")
    ap.add_argument("--probe-batches", type=int, default=8)
    ap.add_argument("--tag", default="")
    args = ap.parse_args(argv)
    cut_at = [int(v) for v in args.cut_at.split(",")]
    logit_at = [int(v) for v in args.logit_at.split(",")]
    triggers = tuple(float(v) for v in args.triggers.split(",") if v)
    rows, t0 = [], time.time()
    for model in args.models.split(","):
        for lr in (float(v) for v in (args.lrs or DEFAULT_LRS[model]).split(",")):
            for seed in (int(v) for v in args.seeds.split(",")):
                o = study(model, lr, seed, args.steps, cut_at, args.factor, args.probe_batches, logit_at,
                          args.rollback_from, triggers)
                rows.append({"model": model, "lr": lr, "seed": seed, "out": o})
                print(f"{model} {lr:g} seed {seed}: unguarded {o['unguarded']['eval']:.3f} "
                      + " ".join(f"cut@{k} {c['eval']:.3f}" for k, c in o["cuts"].items())
                      + f" rollback {o.get('rollback', {}).get('eval', float('nan')):.3f}"
                        f" attn {o.get('attn', float('nan')):.3f} trigger {o.get('trigger')} logits {o['unguarded']['logit']} "
                        f"({time.time() - t0:.0f}s)", flush=True)
    doc = {"steps": args.steps, "factor": args.factor, "cut_at": cut_at, "rollback_from": args.rollback_from,
           "triggers": list(triggers), "logit_at": logit_at, "rows": rows,
           "environment": environment(), "seconds": round(time.time() - t0)}
    write_results(os.path.join(RESULTS_DIR, f"warmup-damage{args.tag}"), doc, markdown(doc))
    print(markdown(doc))
    return doc


if __name__ == "__main__":
    main()
