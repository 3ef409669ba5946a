"""Rehearse your run: train a tiny byte-level GPT with gradguard while gradguard.testing injects
the faults a long run meets, then print what the guard saw and did about each one.

    python examples/rehearse.py               # 160 steps on CPU, a few seconds
    python examples/rehearse.py --monitor     # the same faults with the "monitor" preset
    python examples/rehearse.py --out /tmp/rehearse --tensorboard --wandb   # also to TensorBoard / W&B (offline)

Needs only the base install (``--tensorboard``: the ``tensorboard`` extra, ``--wandb``: ``wandb``).
Everything goes under ``--out`` (default: a new temporary folder): the event log
``<out>/gradguard/events.jsonl`` (``gradguard report <out>`` makes its HTML report), snapshots,
TensorBoard (``<out>/tb``) and W&B (``<out>/wandb``, offline unless ``WANDB_API_KEY`` is set).

Swap in your own model, optimizer and data to rehearse your real setup before a long run.
"""

from __future__ import annotations

import argparse
import errno
import os
import tempfile
from typing import Any

import torch

import gradguard as gg
from gradguard.data import BatchController
from gradguard.demo_model import ByteBatches, TinyGPT, evaluate, load_corpus
from gradguard.testing import (
    CorruptBatch,
    GradFault,
    LRSpike,
    NaNLoss,
    OutOfMemory,
    OverflowStreak,
    SnapshotIOFault,
)


def windows(data: ByteBatches, n: int, seed: int = 0) -> list[dict[str, torch.Tensor]]:
    x, y = data.train_batch(n, torch.Generator().manual_seed(seed))
    return [{"x": a, "y": b} for a, b in zip(x, y)]


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=160)
    ap.add_argument("--monitor", action="store_true", help="observe only (the 'monitor' preset)")
    ap.add_argument("--out", default=None, help="folder for the event log and snapshots (default: a temp dir)")
    ap.add_argument("--tensorboard", action="store_true", help="also a TensorBoardSink (<out>/tb)")
    ap.add_argument("--wandb", action="store_true", help="also a WandbSink (offline unless WANDB_API_KEY is set)")
    ap.add_argument("--no-progress", dest="progress", action="store_false", help="no progress bar")
    args = ap.parse_args(argv)

    torch.manual_seed(0)
    seq = 32
    data = ByteBatches(load_corpus(200_000), seq)
    model = TinyGPT(n_layer=2, width=64, n_head=4, seq_len=seq)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.0)
    scaler = torch.amp.GradScaler("cpu")  # a real GradScaler, as in an fp16 run
    batches = BatchController(windows(data, 8192), batch_size=16, seed=0, epochs=None)
    out = args.out or tempfile.mkdtemp(prefix="gradguard-rehearse-")
    cfg = gg.GuardConfig.preset("monitor" if args.monitor else "default",
                                output={"dir": out, "console": False},
                                recovery={"disk_dir": f"{out}/snapshots", "snapshot_interval": 10, "confirm_steps": 3})
    sink = gg.MemorySink()
    sinks: list = [sink]
    if args.tensorboard:
        sinks.append(gg.TensorBoardSink(f"{out}/tb"))
    if args.wandb:
        sinks.append(gg.WandbSink(project="gradguard-examples", dir=out, name="rehearse",
                                  mode="online" if os.environ.get("WANDB_API_KEY") else "offline"))
    guard = gg.Guard(model, opt, scaler=scaler, config=cfg, sinks=sinks, batches=batches)
    from gradguard.demo import Progress

    bar = Progress("rehearse", args.steps) if args.progress else None

    s = args.steps
    faults = [
        NaNLoss(at_step=s * 20 // 100),
        GradFault("blocks.1", at_step=s * 30 // 100, kind="inf"),
        LRSpike(factor=100, at_step=s * 40 // 100, steps=4),
        CorruptBatch(at_step=s * 55 // 100, steps=6),
        OutOfMemory(at_step=s * 65 // 100, above_batch=8),
        OverflowStreak(at_step=s * 75 // 100, steps=6),
        SnapshotIOFault(at_step=s * 85 // 100, errno=errno.ENOSPC),
    ]
    for f in faults:
        f.attach(model, opt, guard=guard)
    halted = None
    try:
        for i, step_batch in enumerate(batches):
            if i == s:
                break
            guard.accumulate(step_batch, lambda mb: model(mb["x"], mb["y"]))
            report = guard.step()
            opt.zero_grad(set_to_none=True)
            if bar is not None:
                bar(i + 1, report.loss if report.loss is not None else float("nan"))
    except gg.GradGuardHalt as exc:
        halted = exc.diagnosis["reason"]
    finally:
        if bar is not None:
            bar.close()
        for f in faults:
            f.detach()
        summary = guard.close()
        if args.wandb:
            import wandb

            wandb.finish()

    eval_loss = evaluate(model, data.eval_batches(32, 4))
    finite = all(torch.isfinite(p).all() for p in model.parameters())
    print(f"{'monitor' if args.monitor else 'default'} preset, {summary['steps']} steps, "
          f"{summary['skipped']} skipped, eval loss {eval_loss:.3f}, weights finite: {finite}"
          + (f", HALTED: {halted}" if halted else ""))
    report: dict[str, Any] = {}
    for f in faults:
        first = f.fired[0] if f.fired else None
        window = range(first, first + 12) if first else range(0)
        seen = [e for e in sink.events if e.get("step") in window and e.get("type") in (
            "finding", "action", "snapshot_io_error", "snapshot_fallback", "sink_io_error")]
        reaction = sorted({e.get("kind") or e.get("name") or e["type"] for e in seen})
        report[f.name] = {"fired": f.fired, "reaction": reaction}
        print(f"  {f.name:16s} fired at {f.fired[:6]}{'...' if len(f.fired) > 6 else ''}: {', '.join(reaction) or '-'}")
    print(f"event log: {summary['log']}  (HTML report: gradguard report {summary['log']})")
    return {"faults": report, "halted": halted, "eval_loss": eval_loss, "finite": finite, "summary": summary}


if __name__ == "__main__":
    main()
