"""gradguard with PyTorch Lightning: the explosive AdamW setting on a tiny byte-level GPT (CPU, offline).

The setting from the user's notes: AdamW at lr 0.1, beta2 0.999, eps 1e-8, no warm-up, batch 64,
no clipping, on a 2-block TinyGPT reading the Python standard library's sources as bytes.
The only change for the guard is one callback on an unmodified Trainer and LightningModule:

    trainer = L.Trainer(..., callbacks=[GradGuardCallback(GuardConfig())])

Needs the ``lightning`` extra (``pip install -e ".[lightning]"``; ``--tensorboard``: ``[tensorboard]``,
``--wandb``: ``[wandb]``).

    python examples/lightning_gpt.py              # guarded: prints the final eval loss (~1 min)
    python examples/lightning_gpt.py --no-guard   # the same run without the guard
    python examples/lightning_gpt.py --compare --out /tmp/lightning_demo --tensorboard --wandb
                                                  # both (with TensorBoard and offline W&B), plus the
                                                  # monitor-mode overhead per step

Everything goes under ``--out`` (default: a new temporary folder): each run's event log is
``<out>/<run>/gradguard/events.jsonl`` (``gradguard report <out>/<run>`` makes its HTML report),
TensorBoard writes to ``<out>/tb``, W&B to ``<out>/wandb`` (offline unless ``WANDB_API_KEY`` is set).
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

import torch

try:
    import lightning.pytorch as L
except ImportError:  # the standalone package
    import pytorch_lightning as L  # type: ignore[no-redef]

import gradguard as gg
from gradguard.demo_model import ByteBatches, TinyGPT, evaluate, load_corpus

if L.__name__.startswith("lightning"):
    from gradguard.lightning import GradGuardCallback
else:
    from gradguard.pytorch_lightning import GradGuardCallback


class Windows(torch.utils.data.Dataset):
    """``n`` random training windows, fixed by the seed (the same batches for every run)."""

    def __init__(self, data: ByteBatches, n: int, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        self.x, self.y = data.train_batch(n, g)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int):
        return self.x[i], self.y[i]


class LitGPT(L.LightningModule):
    def __init__(self, lr: float = 0.1, beta2: float = 0.999, eps: float = 1e-8, seq_len: int = 32,
                 width: int = 128, n_layer: int = 2) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.model = TinyGPT(n_layer=n_layer, width=width, seq_len=seq_len)

    def training_step(self, batch, batch_idx):
        loss = self.model(*batch)
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def configure_optimizers(self):
        hp = self.hparams
        opt = torch.optim.AdamW(self.parameters(), lr=hp.lr, betas=(0.9, hp.beta2), eps=hp.eps, weight_decay=0.01)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)  # no warm-up (the explosive setting)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


class StepTimer(L.Callback):
    """Wall time per training batch (forward, backward, guard, optimizer step)."""

    def __init__(self) -> None:
        self.times: list[float] = []
        self._t = 0.0

    def on_train_batch_start(self, *args) -> None:
        self._t = time.perf_counter()

    def on_train_batch_end(self, *args) -> None:
        self.times.append(time.perf_counter() - self._t)


def loggers(name: str, out: str, *, tensorboard: bool = False, use_wandb: bool = False) -> list:
    """The run's Lightning loggers: TensorBoard under ``<out>/tb``, W&B (offline without an API key)."""
    found: list = []
    if tensorboard:
        found.append(L.loggers.TensorBoardLogger(os.path.join(out, "tb"), name=name))
    if use_wandb:
        offline = not os.environ.get("WANDB_API_KEY")
        found.append(L.loggers.WandbLogger(name=name, project=os.environ.get("WANDB_PROJECT", "gradguard-examples"),
                                           save_dir=out, offline=offline))
    return found


def run(guard: gg.GuardConfig | None, *, steps: int, batch_size: int, seed: int, data: ByteBatches,
        out: str, timer: StepTimer | None = None, quiet: bool = False, progress: bool = False,
        logger: list | None = None) -> dict:
    L.seed_everything(seed, verbose=False)
    module = LitGPT(seq_len=data.seq_len)
    callbacks: list = [timer] if timer is not None else []
    cb = None
    if guard is not None:
        cb = GradGuardCallback(guard)
        callbacks.append(cb)
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=steps, callbacks=callbacks, logger=logger or False,
                        enable_checkpointing=False, enable_progress_bar=progress, enable_model_summary=False,
                        default_root_dir=out, log_every_n_steps=10)
    loader = torch.utils.data.DataLoader(Windows(data, steps * batch_size, seed), batch_size=batch_size)
    t0 = time.perf_counter()
    trainer.fit(module, loader)
    seconds = time.perf_counter() - t0
    ev = evaluate(module.model, data.eval_batches(64, 8))
    summary = cb.core.summary() if cb is not None and cb.core is not None else None
    for lg in logger or []:
        if type(lg).__name__ == "WandbLogger":
            import wandb

            wandb.finish()  # one W&B run per arm
    return {"eval_loss": ev, "seconds": seconds, "guard": summary, "steps": trainer.global_step}


def summary_line(name: str, r: dict) -> str:
    """One readable line per run, and where its event log is."""
    g = r["guard"] or {}
    acts = ", ".join(f"{k} x{v}" for k, v in (g.get("actions") or {}).items()) or "none"
    line = (f"{name:10s} final eval loss {r['eval_loss']:.3f}, {r['steps']} steps, {r['seconds']:.0f}s"
            + (f", {g.get('skipped', 0)} skipped, gradguard actions: {acts}" if g else ""))
    if g.get("log"):
        line += f"\n{'':11s}event log: {g['log']}  (HTML report: gradguard report {g['log']})"
    return line


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--guard", action=argparse.BooleanOptionalAction, default=True, help="attach GradGuardCallback")
    p.add_argument("--compare", action="store_true", help="unguarded vs guarded, and the monitor-mode overhead")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--seq-len", type=int, default=32)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="folder for everything (default: a new temporary folder)")
    p.add_argument("--tensorboard", action="store_true", help="a TensorBoardLogger (<out>/tb)")
    p.add_argument("--wandb", action="store_true", help="a WandbLogger (offline unless WANDB_API_KEY is set)")
    p.add_argument("--no-progress", dest="progress", action="store_false", help="hide Lightning's progress bar")
    args = p.parse_args(argv)
    out = os.path.abspath(args.out or tempfile.mkdtemp(prefix="gradguard-lightning-"))
    os.makedirs(out, exist_ok=True)
    torch.set_num_threads(max(1, min(4, os.cpu_count() or 1)))
    data = ByteBatches(load_corpus(), args.seq_len)
    kw = {"steps": args.steps, "batch_size": args.batch_size, "seed": args.seed, "data": data}
    guarded_cfg = gg.GuardConfig.preset("default", output={"dir": os.path.join(out, "guarded")})

    def arm(name: str, cfg: gg.GuardConfig | None) -> dict:
        lg = loggers(name, out, tensorboard=args.tensorboard, use_wandb=args.wandb)
        return run(cfg, out=os.path.join(out, name), progress=args.progress, logger=lg, **kw)

    if not args.compare:
        name = "guarded" if args.guard else "unguarded"
        r = arm(name, guarded_cfg if args.guard else None)
        print(summary_line(name, r))
        print(f"outputs: {out}")
        return r
    res = {"unguarded": arm("unguarded", None), "guarded": arm("guarded", guarded_cfg)}
    print()
    for name, r in res.items():
        print(summary_line(name, r))
    # monitor-mode overhead: interleaved short runs in this process, median time per step
    mon = gg.GuardConfig.preset("monitor", output={"console": False, "dir": os.path.join(out, "monitor")})
    ov_kw = dict(kw, steps=min(args.steps, 60))
    plain_t, mon_t = [], []
    for _ in range(3):
        for cfg, acc in ((None, plain_t), (mon, mon_t)):
            t = StepTimer()
            run(cfg, out=os.path.join(out, "overhead"), timer=t, **ov_kw)
            acc.extend(t.times[5:])  # drop the first steps (warm-up of the allocator and threads)
    ratio = statistics.median(mon_t) / statistics.median(plain_t)
    print(f"monitor-mode overhead: {statistics.median(plain_t) * 1e3:.1f} ms/step unguarded, "
          f"{statistics.median(mon_t) * 1e3:.1f} ms/step monitored: ratio {ratio:.3f}")
    print(f"outputs: {out}" + (f"  (tensorboard --logdir {os.path.join(out, 'tb')})" if args.tensorboard else ""))
    res["overhead_ratio"] = ratio
    return res


if __name__ == "__main__":
    main()
