"""LR sensitivity under the HF Trainer (Wortsman et al. 2023, "Small-scale proxies for large-scale
Transformer training instabilities"): how much final loss a run loses when its LR is off.

    python benchmarks/lr_sensitivity.py                        # every arm, the whole grid
    python benchmarks/lr_sensitivity.py --arms unguarded,gradguard --lrs 3e-3,1e-2 --seeds 0
    python benchmarks/lr_sensitivity.py --reuse                # redraw table and picture from the JSON

Setting: a small pre-LN GPT over bytes (3 blocks, width 64, 4 heads, 64 tokens, batch 16) built from
code here, trained by an unmodified ``transformers.Trainer``: AdamW(0.9, 0.95, weight decay 0.1),
``max_grad_norm=1.0``, 10% linear warm-up, cosine decay, 300 steps; eval loss on held-out bytes.
The paper's recipe scaled down. The LR grid is 3e-4 .. 3e-1 (half-decades).

Arms:

* ``unguarded``: the Trainer as configured;
* ``gradguard``: ``callbacks=[gradguard.hf.GradGuardCallback()]``, defaults;
* ``qknorm_zloss``: the paper's own fixes, no guard: LayerNorm on queries and keys, z-loss 1e-4;
* ``zclip``: ``zclip.ZClip()`` defaults called before every optimizer step (ZClip has no HF callback;
  its README's loop call, in ``on_pre_optimizer_step``), the Trainer's own clip off (ZClip's
  ``max_grad_norm=1.0`` is its fallback clip);
* ``arc``: ``arc.api.integrations.HuggingFaceCallback()`` as ARC's README shows (``arc-training``,
  AGPL: a benchmark-only dependency, never imported by gradguard), the user's clip left on.

LR sensitivity of an arm (the paper's definition) = mean over the grid of
``min(loss(lr), initial loss) - best loss over the grid of every arm``; lower is better. Also given:
the cost at the best LR, and the largest LR whose loss stays within 5% of the best (as a multiple of
the best LR). Results: ``benchmarks/results/lr-sensitivity.md`` and ``lr-sensitivity.svg``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import tempfile
import time
import warnings
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from common import RESULTS_DIR, environment  # noqa: E402

from gradguard.demo_model import ByteBatches, load_corpus  # noqa: E402

SEQ, WIDTH, LAYERS, HEADS, BATCH, STEPS = 64, 64, 3, 4, 16, 300
GRID = [3e-4, 1e-3, 3e-3, 1e-2, 3e-2, 1e-1, 3e-1]
ARMS = ["unguarded", "gradguard", "qknorm_zloss", "zclip", "arc"]
INITIAL_LOSS = math.log(256)


class Block(nn.Module):
    def __init__(self, qk_norm: bool) -> None:
        super().__init__()
        self.ln_1, self.ln_2 = nn.LayerNorm(WIDTH), nn.LayerNorm(WIDTH)
        self.qkv, self.proj = nn.Linear(WIDTH, 3 * WIDTH), nn.Linear(WIDTH, WIDTH)
        self.mlp = nn.Sequential(nn.Linear(WIDTH, 4 * WIDTH), nn.GELU(), nn.Linear(4 * WIDTH, WIDTH))
        d = WIDTH // HEADS
        self.q_norm = nn.LayerNorm(d) if qk_norm else nn.Identity()
        self.k_norm = nn.LayerNorm(d) if qk_norm else nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q, k, v = self.qkv(self.ln_1(x)).view(b, t, 3, HEADS, WIDTH // HEADS).unbind(2)
        q, k = self.q_norm(q), self.k_norm(k)
        a = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(b, t, WIDTH))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    """A pre-LN GPT over bytes; ``qk_norm`` and ``z_loss`` are the paper's two fixes."""

    def __init__(self, qk_norm: bool = False, z_loss: float = 0.0) -> None:
        super().__init__()
        self.wte, self.wpe = nn.Embedding(256, WIDTH), nn.Embedding(SEQ, WIDTH)
        self.blocks = nn.ModuleList(Block(qk_norm) for _ in range(LAYERS))
        self.ln_f = nn.LayerNorm(WIDTH)
        self.lm_head = nn.Linear(WIDTH, 256, bias=False)
        self.z_loss = z_loss
        for m in self.modules():
            if isinstance(m, (nn.Linear, nn.Embedding)):
                nn.init.normal_(m.weight, std=0.02)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
        h = self.wte(input_ids) + self.wpe(torch.arange(input_ids.shape[1]))
        for blk in self.blocks:
            h = blk(h)
        logits = self.lm_head(self.ln_f(h))
        out = {"logits": logits}
        if labels is not None:
            lg, y = logits[:, :-1].reshape(-1, 256), labels[:, 1:].reshape(-1)
            loss = F.cross_entropy(lg, y)
            if self.z_loss and self.training:
                loss = loss + self.z_loss * torch.logsumexp(lg, -1).pow(2).mean()
            out["loss"] = loss
        return out


class Windows(torch.utils.data.Dataset):
    """``steps x batch`` fixed random windows of the training bytes (one order per seed)."""

    def __init__(self, data: ByteBatches, n: int, seed: int) -> None:
        gen = torch.Generator().manual_seed(1000 + seed)
        self.x, _ = data.train_batch(n, gen)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.x[i], "labels": self.x[i]}


def _zclip_callback(model: nn.Module) -> Any:
    from transformers import TrainerCallback
    from zclip import ZClip

    class ZClipHF(TrainerCallback):
        def __init__(self) -> None:
            self.zclip = ZClip()

        def on_pre_optimizer_step(self, args, state, control, **kw):  # noqa: ANN001, ANN003
            self.zclip.step(model)

    return ZClipHF()


def _arc_callback() -> Any:
    from arc.api.integrations import HuggingFaceCallback

    return HuggingFaceCallback()


def run(arm: str, lr: float, seed: int, steps: int = STEPS, keep: str | None = None) -> dict[str, Any]:
    """One run; ``keep``: a folder for gradguard's event log (default: a temporary one)."""
    from transformers import Trainer, TrainingArguments

    torch.manual_seed(seed)
    data = ByteBatches(load_corpus(), SEQ)
    model = GPT(qk_norm=arm == "qknorm_zloss", z_loss=1e-4 if arm == "qknorm_zloss" else 0.0)
    tmp = tempfile.TemporaryDirectory(prefix="gg-lrs-")
    callbacks: list[Any] = []
    summary: dict[str, Any] = {}
    if arm == "gradguard":
        from gradguard import GuardConfig
        from gradguard.hf import GradGuardCallback

        callbacks.append(GradGuardCallback(GuardConfig(output={"console": False}), out_dir=keep or tmp.name))
    elif arm == "zclip":
        callbacks.append(_zclip_callback(model))
    elif arm == "arc":
        callbacks.append(_arc_callback())
    args = TrainingArguments(
        output_dir=tmp.name, use_cpu=True, report_to=[], seed=seed, max_steps=steps, per_device_train_batch_size=BATCH,
        learning_rate=lr, adam_beta1=0.9, adam_beta2=0.95, weight_decay=0.1, warmup_steps=steps // 10,
        lr_scheduler_type="cosine", max_grad_norm=0.0 if arm == "zclip" else 1.0, logging_steps=10,
        save_strategy="no", disable_tqdm=True, dataloader_drop_last=True)
    trainer = Trainer(model=model, args=args, train_dataset=Windows(data, steps * BATCH, seed), callbacks=callbacks)
    t0 = time.time()
    trainer.train()
    secs = time.time() - t0
    model.eval()
    with torch.no_grad():
        evals = [float(model(x, x)["loss"]) for x, _ in data.eval_batches(64, 4)]
    ev = sum(evals) / len(evals)
    if arm == "gradguard":
        summary = callbacks[0].summary or {}
    tmp.cleanup()
    return {"arm": arm, "lr": lr, "seed": seed, "eval": ev if math.isfinite(ev) else float("inf"),
            "seconds": round(secs, 1), "actions": summary.get("actions", {})}


# -- scoring ----------------------------------------------------------------------------------------------
def curves(rows: list[dict[str, Any]]) -> dict[str, dict[float, float]]:
    """arm -> lr -> mean eval loss over seeds."""
    acc: dict[str, dict[float, list[float]]] = {}
    for r in rows:
        acc.setdefault(r["arm"], {}).setdefault(r["lr"], []).append(min(r["eval"], 1e9))
    return {a: {lr: sum(v) / len(v) for lr, v in sorted(d.items())} for a, d in acc.items()}


def score(cv: dict[str, dict[float, float]]) -> dict[str, dict[str, Any]]:
    best = min(min(d.values()) for d in cv.values())
    base = cv.get("unguarded", {})
    best_lr = min(base, key=base.get) if base else None
    out: dict[str, dict[str, Any]] = {}
    for arm, d in cv.items():
        sens = sum(min(v, INITIAL_LOSS) - best for v in d.values()) / len(d)
        own_best = min(d.values())
        ok = [lr for lr, v in d.items() if v <= 1.05 * own_best]
        cost = (d[best_lr] / base[best_lr] - 1) if best_lr in d else float("nan")
        out[arm] = {"sensitivity": sens, "best": own_best, "cost_at_best_lr": cost,
                    "largest_ok_lr_x": max(ok) / best_lr if best_lr else float("nan")}
    return out


def markdown(doc: dict[str, Any]) -> str:
    cv, sc = doc["curves"], doc["score"]
    lrs = sorted({lr for d in cv.values() for lr in d})
    arms = [a for a in ARMS if a in cv]
    head = "| arm | " + " | ".join(f"{lr:g}" for lr in lrs) + " | LR sensitivity | at best LR | largest LR within 5% |"
    lines = [head, "|" + "---|" * (len(lrs) + 4)]
    for a in arms:
        cells = [f"{cv[a][lr]:.3f}" if lr in cv[a] else "" for lr in lrs]
        s = sc[a]
        lines.append(f"| {a} | " + " | ".join(cells) + f" | {s['sensitivity']:.3f} | {s['cost_at_best_lr']:+.1%} | "
                     f"{s['largest_ok_lr_x']:.3g}x |")
    seeds = sorted({r["seed"] for r in doc["rows"]})
    lines.append("")
    lines.append(f"Eval loss (mean over seeds {seeds}), HF Trainer, {doc['steps']} steps; initial loss {INITIAL_LOSS:.3f}. "
                 "LR sensitivity: mean over the grid of min(loss, initial) - best loss of any arm (lower is better). "
                 "'At best LR': the arm's loss at the unguarded best LR against unguarded's.")
    return "\n".join(lines) + "\n"


def svg(doc: dict[str, Any]) -> str:
    """The curves as a dependency-free SVG (log-x LR, eval loss capped at the initial loss)."""
    cv = doc["curves"]
    w, h, pad = 640, 360, 50
    lrs = sorted({lr for d in cv.values() for lr in d})
    lo = min(min(d.values()) for d in cv.values()) - 0.05
    hi = INITIAL_LOSS + 0.05
    x0, x1 = math.log10(lrs[0]), math.log10(lrs[-1])

    def px(lr: float) -> float:
        return pad + (math.log10(lr) - x0) / max(1e-9, x1 - x0) * (w - 2 * pad)

    def py(v: float) -> float:
        return h - pad - (min(v, INITIAL_LOSS) - lo) / (hi - lo) * (h - 2 * pad)

    colors = {"unguarded": "#888888", "gradguard": "#d62728", "qknorm_zloss": "#1f77b4", "zclip": "#2ca02c", "arc": "#9467bd"}
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" font-family="sans-serif" font-size="12">',
             f'<rect width="{w}" height="{h}" fill="white"/>',
             f'<text x="{w / 2}" y="18" text-anchor="middle">Final eval loss vs learning rate (HF Trainer, pre-LN GPT)</text>']
    for lr in lrs:
        parts.append(f'<line x1="{px(lr):.1f}" y1="{h - pad}" x2="{px(lr):.1f}" y2="{pad}" stroke="#eee"/>')
        parts.append(f'<text x="{px(lr):.1f}" y="{h - pad + 16}" text-anchor="middle">{lr:g}</text>')
    for i in range(5):
        v = lo + (hi - lo) * i / 4
        parts.append(f'<text x="{pad - 6}" y="{py(v) + 4:.1f}" text-anchor="end">{v:.2f}</text>')
    for j, (arm, d) in enumerate((a, cv[a]) for a in ARMS if a in cv):
        pts = " ".join(f"{px(lr):.1f},{py(v):.1f}" for lr, v in sorted(d.items()))
        c = colors.get(arm, "#000")
        parts.append(f'<polyline fill="none" stroke="{c}" stroke-width="{3 if arm == "gradguard" else 1.5}" points="{pts}"/>')
        parts.append(f'<text x="{w - pad - 90}" y="{pad + 14 * j}" fill="{c}">{arm}</text>')
    parts.append(f'<text x="{w / 2}" y="{h - 8}" text-anchor="middle">learning rate (log)</text></svg>')
    return "\n".join(parts) + "\n"


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--arms", default=",".join(ARMS))
    p.add_argument("--lrs", default=",".join(f"{x:g}" for x in GRID))
    p.add_argument("--seeds", default="0")
    p.add_argument("--steps", type=int, default=STEPS)
    p.add_argument("--tag", default="lr-sensitivity")
    p.add_argument("--reuse", action="store_true", help="keep rows already in the JSON; run only the missing ones")
    a = p.parse_args(argv)
    warnings.filterwarnings("ignore")
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    torch.set_num_threads(1)
    path = os.path.join(RESULTS_DIR, f"{a.tag}.json")
    rows: list[dict[str, Any]] = []
    if a.reuse and os.path.exists(path):
        with open(path) as fh:
            rows = json.load(fh)["rows"]
    have = {(r["arm"], r["lr"], r["seed"]) for r in rows}
    for seed in (int(s) for s in a.seeds.split(",")):
        for lr in (float(x) for x in a.lrs.split(",")):
            for arm in a.arms.split(","):
                if (arm, lr, seed) in have:
                    continue
                r = run(arm, lr, seed, a.steps)
                rows.append(r)
                print(f"{arm:13s} lr {lr:<7g} seed {seed}: eval {r['eval']:.3f} ({r['seconds']}s) {r['actions']}", flush=True)
                doc = {"steps": a.steps, "rows": rows, "env": environment()}
                with open(path, "w") as fh:
                    json.dump(doc, fh, indent=1)
    doc = {"steps": a.steps, "rows": rows, "env": environment()}
    doc["curves"] = curves(rows)
    doc["score"] = score(doc["curves"])
    with open(path, "w") as fh:
        json.dump({**doc, "curves": {k: {str(lr): v for lr, v in d.items()} for k, d in doc["curves"].items()}}, fh, indent=1)
    with open(os.path.join(RESULTS_DIR, f"{a.tag}.md"), "w") as fh:
        fh.write(markdown(doc))
    with open(os.path.join(RESULTS_DIR, f"{a.tag}.svg"), "w") as fh:
        fh.write(svg(doc))
    print(markdown(doc))
    return doc


if __name__ == "__main__":
    main()
