"""Setups no rule was tuned on: other optimizers, architectures, losses and data, with and without a fault.

    python benchmarks/unseen.py                          # 10 setups x 4 conditions x 3 arms (~15 min, 1 core)
    python benchmarks/unseen.py --setups lstm_adam --conditions healthy,lr10
    python benchmarks/unseen.py --jitter 4               # + the noise band of every row the guard ends worse
    python benchmarks/unseen.py --setups nadam,radam,adamax,adadelta,sgd_nesterov,rmsprop_centered_mom,adam_amsgrad --tag=-optimizers

The rescue and compound benchmarks train transformers and a CNN language model with AdamW. A user
brings other things: SGD with momentum, Adagrad, RMSprop, an LSTM, a BatchNorm image classifier, a
regression MLP with an MSE loss, bf16 autocast, a batch of 2, a run that memorizes a few batches
(its loss goes to ~0), a constant LR. Each setup trains 300 steps (10% warm-up then cosine, unless
constant) under four conditions:

* ``healthy``: nothing wrong (counts the guard's actions: every one is a false alarm);
* ``spike``: the LR x30 for 4 steps at step 200 (through the scheduler, so every arm sees it);
* ``garbage``: 10 batches of random bytes at step 150 (inputs x50 for the non-text setups);
* ``lr10``: the LR 10x the setup's own throughout.

Arms: ``none`` (no clip), ``clip1`` (``clip_grad_norm_(1.0)``, what most users run), ``guard``
(``gradguard.Guard`` defaults: it clips at 1.0 itself). The guard is compared with both: the user who
clipped and the user who did not. Harmed: final loss worse by more than 0.5% (for the setups whose
loss ends near 0, ``memorize`` and ``bn_cnn_sgd``, a relative gap is large in few nats: the table
gives both). Results: ``results/unseen.md``.

``--jitter K``: a row where the guard ends worse than a baseline also trains K copies of that
baseline and of the guard at the LR x (1 + 0.001 k), k = 1..K (a change that should not matter):
their spread is the run's noise band (an AdamW run at 10x its LR without a schedule moves 3.5%),
and the row is worse *beyond noise* only when the guard's whole band is worse than the baseline's
whole band by more than 0.5%. ``MORE_SETUPS`` (not in the default run; name them in ``--setups``):
seven more optimizers on the same GPT (NAdam, RAdam, Adamax, Adadelta, SGD with Nesterov momentum,
centered RMSprop with momentum, Adam with AMSGrad).
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from common import RESULTS_DIR, environment, write_results  # noqa: E402

import gradguard as gg  # noqa: E402
from gradguard.demo_model import ByteBatches, TinyGPT, load_corpus  # noqa: E402

STEPS = 300
HARMED = 1.005
#: ``--jitter K``: copies at the LR x (1 + JITTER * k), k = 1..K
JITTER = 1e-3
CONDITIONS = ("healthy", "spike", "garbage", "lr10")
ARMS = ("none", "clip1", "guard")
_DATA: ByteBatches | None = None


def text() -> ByteBatches:
    global _DATA
    if _DATA is None:
        _DATA = ByteBatches(load_corpus(), 64)
    return _DATA


# -- models -----------------------------------------------------------------------------------------
class LSTMLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb, self.rnn, self.head = nn.Embedding(256, 64), nn.LSTM(64, 128, 2, batch_first=True), nn.Linear(128, 256)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h, _ = self.rnn(self.emb(x))
        return F.cross_entropy(self.head(h).reshape(-1, 256), y.reshape(-1))


class BNConv(nn.Module):
    """A small image classifier with BatchNorm (10 classes of synthetic 16x16 images)."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(), nn.MaxPool2d(2),
                                 nn.Conv2d(16, 32, 3, padding=1), nn.BatchNorm2d(32), nn.ReLU(),
                                 nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(32, 10))

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(self.net(x), y)


class MLPReg(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(16, 128), nn.GELU(), nn.Linear(128, 128), nn.GELU(), nn.Linear(128, 1))

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.mse_loss(self.net(x).squeeze(-1), y)


def gpt() -> nn.Module:
    return TinyGPT(n_layer=2, width=64, n_head=4, seq_len=64)


# -- data -------------------------------------------------------------------------------------------
def batches(kind: str, seed: int, bs: int) -> Callable[[], tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    if kind == "text":
        return lambda: text().train_batch(bs, g)
    if kind == "img":
        protos = torch.randn(10, 3, 8, 8, generator=torch.Generator().manual_seed(123))

        def img() -> tuple[torch.Tensor, torch.Tensor]:
            y = torch.randint(0, 10, (bs,), generator=g)
            return F.interpolate(protos[y], size=16) + 0.8 * torch.randn(bs, 3, 16, 16, generator=g), y
        return img
    if kind == "reg":
        w = torch.randn(16, generator=torch.Generator().manual_seed(7))

        def reg() -> tuple[torch.Tensor, torch.Tensor]:
            x = torch.randn(bs, 16, generator=g)
            return x, torch.sin(x @ w) + 0.01 * torch.randn(bs, generator=g)
        return reg
    if kind == "memorize":  # 4 fixed batches: the loss goes to ~0
        fixed = [text().train_batch(bs, torch.Generator().manual_seed(99 + i)) for i in range(4)]
        i = [0]

        def mem() -> tuple[torch.Tensor, torch.Tensor]:
            i[0] += 1
            return fixed[i[0] % 4]
        return mem
    raise ValueError(kind)


@dataclass(frozen=True)
class Setup:
    model: Callable[[], nn.Module]
    data: str
    opt: Callable[[Any], torch.optim.Optimizer]
    batch: int = 16
    bf16: bool = False
    schedule: bool = True  # warm-up + cosine; False: constant


SETUPS: dict[str, Setup] = {
    "sgd_momentum": Setup(gpt, "text", lambda p: torch.optim.SGD(p, lr=0.3, momentum=0.9)),
    "adamw_bf16": Setup(gpt, "text", lambda p: torch.optim.AdamW(p, lr=3e-3), bf16=True),
    "lstm_adam": Setup(LSTMLM, "text", lambda p: torch.optim.Adam(p, lr=3e-3)),
    "bn_cnn_sgd": Setup(BNConv, "img", lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9, weight_decay=5e-4), batch=32),
    "mlp_regression": Setup(MLPReg, "reg", lambda p: torch.optim.AdamW(p, lr=1e-3), batch=64),
    "batch2_noisy": Setup(gpt, "text", lambda p: torch.optim.AdamW(p, lr=1e-3), batch=2),
    "memorize": Setup(gpt, "memorize", lambda p: torch.optim.AdamW(p, lr=3e-3), batch=8),
    "adagrad": Setup(gpt, "text", lambda p: torch.optim.Adagrad(p, lr=3e-2)),
    "constant_lr": Setup(gpt, "text", lambda p: torch.optim.AdamW(p, lr=3e-3), schedule=False),
    "rmsprop": Setup(gpt, "text", lambda p: torch.optim.RMSprop(p, lr=1e-3)),
}

#: more optimizers on the same GPT (``--setups`` names them; not in the default run)
MORE_SETUPS: dict[str, Setup] = {
    "nadam": Setup(gpt, "text", lambda p: torch.optim.NAdam(p, lr=3e-3)),
    "radam": Setup(gpt, "text", lambda p: torch.optim.RAdam(p, lr=3e-3)),
    "adamax": Setup(gpt, "text", lambda p: torch.optim.Adamax(p, lr=3e-3)),
    "adadelta": Setup(gpt, "text", lambda p: torch.optim.Adadelta(p, lr=1.0)),
    "sgd_nesterov": Setup(gpt, "text", lambda p: torch.optim.SGD(p, lr=0.3, momentum=0.9, nesterov=True)),
    "rmsprop_centered_mom": Setup(gpt, "text", lambda p: torch.optim.RMSprop(p, lr=3e-4, momentum=0.9, centered=True)),
    "adam_amsgrad": Setup(gpt, "text", lambda p: torch.optim.Adam(p, lr=3e-3, amsgrad=True)),
}


def run(name: str, condition: str, arm: str, seed: int = 0, lr_scale: float = 1.0,
        guard_config: dict[str, Any] | None = None) -> dict[str, Any]:
    """One run; its final loss is the mean over 8 fresh batches of the training distribution.
    ``lr_scale``: the LR times this (the jittered copies); ``guard_config``: GuardConfig fields for
    the guard arm (a rule switched off, to measure what it does)."""
    s = {**SETUPS, **MORE_SETUPS}[name]
    torch.manual_seed(seed)
    model = s.model()
    opt = s.opt(model.parameters())
    for group in opt.param_groups:
        group["lr"] *= (10 if condition == "lr10" else 1) * lr_scale

    def factor(t: int) -> float:
        spike = 30.0 if condition == "spike" and 200 <= t < 204 else 1.0
        if not s.schedule:
            return spike
        return spike * min(1.0, (t + 1) / (STEPS // 10)) * 0.5 * (1 + math.cos(math.pi * min(1.0, t / STEPS)))

    sched = torch.optim.lr_scheduler.LambdaLR(opt, factor)
    get = batches(s.data, seed, s.batch)
    tmp = tempfile.TemporaryDirectory(prefix="gg-unseen-")
    guard = (gg.Guard(model, opt, scheduler=sched, config=gg.GuardConfig(**{**(guard_config or {}), "output": {"console": False}}), out_dir=tmp.name)
             if arm == "guard" else None)
    for t in range(STEPS):
        x, y = get()
        if condition == "garbage" and 150 <= t < 160:
            if x.dtype == torch.long:
                x, y = torch.randint(0, 256, x.shape), torch.randint(0, 256, y.shape)
            else:
                x = x * 50
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=s.bf16):
            loss = model(x, y)
        loss.float().backward()
        if guard is not None:
            guard.step(loss)
        else:
            if arm == "clip1":
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
        opt.zero_grad(set_to_none=True)
    summary = guard.close() if guard is not None else {}
    model.eval()
    fresh = batches(s.data, 10_000 + seed, s.batch)
    with torch.no_grad():
        final = sum(float(model(*fresh())) for _ in range(8)) / 8
    tmp.cleanup()
    return {"final": final if math.isfinite(final) else float("inf"),
            "actions": dict(summary.get("actions", {})), "findings": summary.get("findings", 0)}


def judge(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """False alarms (actions on healthy runs) and the rows the guard ends worse than each baseline."""
    def worse(r: dict[str, Any], base: str) -> bool:
        return r["guard"]["final"] > HARMED * r[base]["final"]

    return {"runs": len(rows),
            "healthy_actions": sum(sum(r["guard"]["actions"].values()) for r in rows if r["condition"] == "healthy"),
            "healthy_runs": sum(r["condition"] == "healthy" for r in rows),
            "worse_than_clip1": [f"{r['condition']}/{r['setup']}" for r in rows if worse(r, "clip1")],
            "worse_than_none": [f"{r['condition']}/{r['setup']}" for r in rows if worse(r, "none")],
            "better_than_clip1": sum(r["guard"]["final"] < r["clip1"]["final"] / HARMED for r in rows),
            "worse_beyond_noise": [f"{r['condition']}/{r['setup']} (vs {base})" for r in rows
                                   for base in ("clip1", "none") if beyond_noise(r, base)]}


def band(row: dict[str, Any], arm: str) -> tuple[float, float]:
    """(lowest, highest) final loss of the arm's run and its jittered copies (if any)."""
    finals = [row[arm]["final"], *(j["final"] for j in row.get("jitter", {}).get(arm, []))]
    return min(finals), max(finals)


def beyond_noise(row: dict[str, Any], base: str) -> bool:
    """The guard's whole band is worse than the baseline's whole band by more than 0.5% (only for
    rows whose bands were trained)."""
    jit = row.get("jitter", {})
    return bool(jit.get(base)) and bool(jit.get("guard")) and band(row, "guard")[0] > HARMED * band(row, base)[1]


def markdown(doc: dict[str, Any]) -> str:
    s = doc["summary"]
    lines = ["# Unseen setups", "",
             f"{s['runs']} runs of {STEPS} steps (benchmarks/unseen.py, seed {doc.get('seed', 0)}). Final loss: mean over "
             "8 fresh batches. "
             f"Worse: by more than {HARMED - 1:.1%}.", "",
             f"- guard actions on {s['healthy_runs']} healthy runs: {s['healthy_actions']}",
             f"- guard better than clip 1.0 in {s['better_than_clip1']}, worse in {len(s['worse_than_clip1'])}: "
             f"{s['worse_than_clip1'] or ''}",
             f"- guard worse than no clip in {len(s['worse_than_none'])}: {s['worse_than_none'] or ''}",
             *([f"- noise bands (the run and {doc['jitter']} copies at the LR x 1.001, 1.002, ...) of the rows above: "
                f"worse beyond both bands in {len(s['worse_beyond_noise'])}: {s['worse_beyond_noise'] or ''}"]
               if doc.get("jitter") else []), "",
             "| condition | setup | none | clip 1.0 | guard | guard / clip 1.0 | guard / none | guard actions |",
             "|---|---|---|---|---|---|---|---|"]
    for r in doc["rows"]:
        n, c, g = r["none"]["final"], r["clip1"]["final"], r["guard"]["final"]
        acts = ", ".join(f"{k} {v}" for k, v in sorted(r["guard"]["actions"].items())) or "-"
        lines.append(f"| {r['condition']} | {r['setup']} | {n:.4f} | {c:.4f} | {g:.4f} | {g / c:.3f} | "
                     f"{g / n if math.isfinite(n) else 0:.3f} | {acts} |")
    banded = [r for r in doc["rows"] if r.get("jitter")]
    if banded:
        lines += ["", "Noise bands (lowest-highest of the run and its copies at the jittered LRs):", "",
                  "| condition | setup | arm | band | guard band |", "|---|---|---|---|---|"]
        for r in banded:
            for base in (b for b in ("clip1", "none") if b in r["jitter"]):
                lines.append(f"| {r['condition']} | {r['setup']} | {base} | {band(r, base)[0]:.4f}-{band(r, base)[1]:.4f} | "
                             f"{band(r, 'guard')[0]:.4f}-{band(r, 'guard')[1]:.4f} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--setups", default=",".join(SETUPS))
    ap.add_argument("--conditions", default=",".join(CONDITIONS))
    ap.add_argument("--tag", default="")
    ap.add_argument("--seed", type=int, default=0, help="the runs' seed (model init and data order)")
    ap.add_argument("--jitter", type=int, default=0, metavar="K",
                    help="rows the guard ends worse: K copies of the baseline and the guard at the LR x 1.001..")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    rows, t0 = [], time.time()
    for condition in args.conditions.split(","):
        for name in args.setups.split(","):
            row: dict[str, Any] = {"setup": name, "condition": condition}
            for arm in ARMS:
                row[arm] = run(name, condition, arm, args.seed)
            worse = [b for b in ("clip1", "none") if row["guard"]["final"] > HARMED * row[b]["final"]]
            if args.jitter and worse:
                row["jitter"] = {arm: [run(name, condition, arm, args.seed, lr_scale=1 + JITTER * k)
                                       for k in range(1, args.jitter + 1)] for arm in ("guard", *worse)}
            rows.append(row)
            print(f"{condition}/{name}: none {row['none']['final']:.4f} clip1 {row['clip1']['final']:.4f} "
                  f"guard {row['guard']['final']:.4f} {row['guard']['actions']} ({time.time() - t0:.0f}s)", flush=True)
    doc = {"rows": rows, "summary": judge(rows), "seed": args.seed, "jitter": args.jitter, "environment": environment(),
           "seconds": round(time.time() - t0)}
    write_results(os.path.join(RESULTS_DIR, f"unseen{args.tag}"), doc, markdown(doc))
    print(markdown(doc))
    return doc


if __name__ == "__main__":
    main()
