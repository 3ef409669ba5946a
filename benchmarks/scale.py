"""Cost of guarding a multi-process run: the per-step collective and per-rank snapshots.

One command, every rank started here (``torch.multiprocessing``)::

    python benchmarks/scale.py                      # 2 gloo processes on the CPU
    python benchmarks/scale.py --backend nccl       # one process per GPU (NCCL)

For each strategy (DDP; ``zero``: DDP with torch's ``ZeroRedundancyOptimizer``; FSDP2
``fully_shard``; ``fsdp1``: FSDP1 with flat parameters, one unit per layer; ``deepspeed``: DeepSpeed
ZeRO-2, ``engine.backward`` + ``engine.step`` / ``guard.step``, when deepspeed is installed) the arms
run interleaved, in rounds, on the same model, data and process group:

* ``unguarded``: ``backward`` + ``clip_grad_norm_`` (FSDP1: ``model.clip_grad_norm_``) +
  ``optimizer.step()`` (the usual loop);
* ``no_clip``: ``backward`` + ``optimizer.step()`` (no norm at all);
* ``guard``: ``gg.Guard.step`` (norms, the step's one all-reduce, detection, clipping), no snapshots;
* ``guard_snap``: the same with a snapshot of each rank's own state every step (the worst case:
  the default interval is 50 steps);
* ``guard_sync`` (DDP only): ``guard`` with gradguard's own gradient sync instead of DDP's
  (:class:`gradguard.oom.EveryRank`: the backward without DDP's all-reduce, then the vote and the
  bucketed average), what ``guard.accumulate`` on a DDP model and ``recovery.oom_all_ranks`` cost:
  the all-reduce no longer overlaps the backward.

The arms alternate step by step (the order rotating), so load drift on a shared machine hits all
of them alike. Step times are medians over the measured steps (rank 0's, between barriers so the
ranks are in step); a ratio is the median over rounds of (arm's median / ``unguarded``'s median in
that round), with the 25th-75th percentile of the rounds in brackets. The bare collective (the packed
all-reduce of the per-layer squares, loss and scale) and one snapshot are timed on their own as
well. Results: ``benchmarks/results/scale-<date>-<backend>.{json,md}``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import socket
import statistics
import sys
import time
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS_DIR = os.path.join(ROOT, "benchmarks", "results")
sys.path.insert(0, ROOT)

import gradguard as gg  # noqa: E402
from gradguard.deepspeed import DeepSpeedGuard  # noqa: E402

ARMS = ("unguarded", "no_clip", "guard", "guard_snap", "guard_sync")


def arms_of(strategy: str) -> tuple[str, ...]:
    return ARMS if strategy == "ddp" else ARMS[:-1]


class MLP(nn.Module):
    def __init__(self, width: int, depth: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(depth))
        self.head = nn.Linear(width, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = x + torch.tanh(layer(x))
        return self.head(x)


def build_deepspeed(arm: str, args: argparse.Namespace, device: torch.device) -> Any:
    """A ZeRO-2 engine; the ``no_clip`` arm's engine does not clip (gradient_clipping 0)."""
    import deepspeed

    torch.manual_seed(0)
    model = MLP(args.width, args.depth).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    config = {"train_micro_batch_size_per_gpu": args.batch, "gradient_accumulation_steps": 1,
              "gradient_clipping": 0.0 if arm == "no_clip" else 1.0, "zero_optimization": {"stage": 2},
              "steps_per_print": 10**9}
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=opt, config=config)
    return engine


def build(strategy: str, args: argparse.Namespace, device: torch.device) -> nn.Module:
    torch.manual_seed(0)
    model = MLP(args.width, args.depth).to(device)
    if strategy in ("ddp", "zero"):
        return nn.parallel.DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)
    if strategy == "fsdp1":  # FSDP1 with flat parameters (its default use_orig_params=False), a unit per layer
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
        from torch.distributed.fsdp.wrap import ModuleWrapPolicy

        return FSDP(model, auto_wrap_policy=ModuleWrapPolicy({nn.Linear}), device_id=device)
    from torch.distributed.fsdp import fully_shard

    for layer in model.layers:
        fully_shard(layer)
    fully_shard(model)
    return model


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    dist.barrier()


def run_arm(arm: str, model: nn.Module, opt: torch.optim.Optimizer, guard: Any, batches: list, steps: int,
            device: torch.device) -> list[float]:
    times = []
    for i in range(steps):
        x, y = batches[i % len(batches)]
        sync(device)
        t0 = time.perf_counter()
        ranks = None
        if arm == "guard_sync":
            from gradguard.oom import EveryRank

            ranks = EveryRank(guard.oom, model, guard.core.collective)
            ranks.open_step()
        loss = nn.functional.cross_entropy(model(x), y)
        if type(model).__name__ == "DeepSpeedEngine":  # the engine backwards, clips and steps itself
            model.backward(loss)
            if arm in ("unguarded", "no_clip"):
                model.step()
            else:
                guard.step(loss)
            sync(device)
            times.append(time.perf_counter() - t0)
            continue
        loss.backward()
        if ranks is not None:
            ranks.close_step([p for p in model.parameters() if p.requires_grad], len(x))
            ranks.release()
        if arm == "unguarded":
            if hasattr(model, "clip_grad_norm_"):  # FSDP1: its own clip (the global norm: one all-reduce)
                model.clip_grad_norm_(1.0)
            else:
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
        elif arm == "no_clip":
            opt.step()
        else:
            guard.step(loss)
        opt.zero_grad(set_to_none=True)
        sync(device)
        times.append(time.perf_counter() - t0)
    return times


def time_collective(n: int, device: torch.device, reps: int) -> float:
    """Median seconds of the guard's per-step all-reduce alone (``n`` floats)."""
    from gradguard.contract import TorchCollective

    coll = TorchCollective()
    packed = torch.zeros(n, device=device)
    out = []
    for _ in range(reps):
        sync(device)
        t0 = time.perf_counter()
        coll.mean(packed.clone()).tolist()
        out.append(time.perf_counter() - t0)
    return statistics.median(out)


def _pct(values: list[float], q: float) -> float:
    v = sorted(values)
    return v[min(len(v) - 1, max(0, round(q / 100 * (len(v) - 1))))]


def worker(rank: int, world: int, args: argparse.Namespace, port: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank))
    torch.set_num_threads(args.threads)
    device = torch.device("cuda", rank) if args.backend == "nccl" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(args.backend, rank=rank, world_size=world)
    gen = torch.Generator().manual_seed(rank)
    batches = [(torch.randn(args.batch, args.width, generator=gen).to(device),
                torch.randint(0, 16, (args.batch,), generator=gen).to(device)) for _ in range(8)]
    results: dict[str, Any] = {}
    for strategy in args.strategies:
        quiet = {"console": False, "jsonl": False}
        arms: dict[str, tuple[nn.Module, torch.optim.Optimizer, Any]] = {}
        names = arms_of(strategy)
        for arm in names:  # one model, optimizer and guard per arm (same initial weights and data)
            if strategy == "deepspeed":
                model = build_deepspeed(arm, args, device)
                guard = None if arm in ("unguarded", "no_clip") else DeepSpeedGuard(model, config=gg.GuardConfig.preset(
                    "default", output=quiet, recovery={"snapshot_interval": 1 if arm == "guard_snap" else 0}))
                opt = model.optimizer
                arms[arm] = (model, opt, guard)
                run_arm(arm, model, model.optimizer, guard, batches, args.warmup, device)
                continue
            model = build(strategy, args, device)
            if strategy == "zero":  # ZeRO-1: the optimizer state sharded over the ranks
                from torch.distributed.optim import ZeroRedundancyOptimizer

                opt: Any = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.AdamW, lr=1e-4)
            else:
                opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
            guard = None if arm in ("unguarded", "no_clip") else gg.Guard(model, opt, config=gg.GuardConfig.preset(
                "default", output=quiet, recovery={"snapshot_interval": 1 if arm == "guard_snap" else 0}))
            arms[arm] = (model, opt, guard)
            run_arm(arm, model, opt, guard, batches, args.warmup, device)
        per_arm: dict[str, list[float]] = {a: [] for a in names}
        ratios: dict[str, list[float]] = {a: [] for a in names if a != "unguarded"}
        for rnd in range(args.rounds):
            times: dict[str, list[float]] = {a: [] for a in names}
            for i in range(args.steps):  # interleaved step by step, the order rotating: load drift cancels
                k = (rnd + i) % len(names)
                for arm in names[k:] + names[:k]:
                    times[arm].extend(run_arm(arm, *arms[arm], batches[i % len(batches):], 1, device))
            med = {}
            for arm in names:
                per_arm[arm].extend(times[arm])
                med[arm] = statistics.median(times[arm])
            for arm in ratios:
                ratios[arm].append(med[arm] / med["unguarded"])
        snap_guard = arms["guard_snap"][2]
        ring = snap_guard.core.snapshots
        n_packed = len(snap_guard.core.layers) + 3  # per-layer squares, loss, scale, flag
        results[strategy] = {
            "median_step_s": {a: statistics.median(v) for a, v in per_arm.items()},
            "ratio_vs_unguarded": {a: statistics.median(v) for a, v in ratios.items()},
            "ratio_iqr": {a: [_pct(v, 25), _pct(v, 75)] for a, v in ratios.items()},
            "ratio_rounds": ratios,
            "collective_s": time_collective(n_packed, device, args.reps),
            "packed_floats": n_packed,
            "snapshot_s_per_rank": ring.total_seconds / max(1, ring.taken),
            "snapshot_bytes_per_rank": ring.last_nbytes,
            "params": sum(p.numel() for p in MLP(args.width, args.depth).parameters()),
            "layers": len(snap_guard.core.layers),
        }
        for _, _, g in arms.values():
            if g is not None:
                g.close()
        del model, opt, guard, arms, snap_guard, ring
    if rank == 0:
        write(results, args, world)
    import gc

    gc.collect()
    dist.barrier()
    dist.destroy_process_group()


def write(results: dict[str, Any], args: argparse.Namespace, world: int) -> None:
    os.makedirs(args.out, exist_ok=True)
    stamp = time.strftime("%Y-%m-%d")
    name = f"scale-{stamp}-{args.backend}{world}"
    doc = {"backend": args.backend, "world": world, "torch": torch.__version__, "machine": platform.machine(),
           "cpus": os.cpu_count(), "gpu": torch.cuda.get_device_name(0) if args.backend == "nccl" else None,
           "config": {k: v for k, v in vars(args).items() if k != "out"}, "results": results}
    with open(os.path.join(args.out, name + ".json"), "w") as fh:
        json.dump(doc, fh, indent=1)
    lines = [f"Scale-out cost, {args.backend}, {world} processes ({doc['gpu'] or f'{os.cpu_count()} CPUs'}), "
             f"MLP {args.depth}x{args.width} ({next(iter(results.values()))['params']:,} parameters), "
             f"batch {args.batch}/rank, {args.rounds} interleaved rounds x {args.steps} steps", "",
             "| strategy | unguarded step (clip_grad_norm_) | no clip (ratio) | guard step (ratio) | "
             "guard + snapshot every step (ratio) | guard, gradguard's own gradient sync (ratio) | "
             "all-reduce alone | snapshot per rank |",
             "|---|---|---|---|---|---|---|---|"]
    for strategy, r in results.items():
        m, q, iqr = r["median_step_s"], r["ratio_vs_unguarded"], r["ratio_iqr"]
        lines.append(f"| {strategy} | {m['unguarded'] * 1e3:.2f} ms | {m['no_clip'] * 1e3:.2f} ms "
                     f"({q['no_clip']:.2f}x [{iqr['no_clip'][0]:.2f}, {iqr['no_clip'][1]:.2f}]) | {m['guard'] * 1e3:.2f} ms ({q['guard']:.2f}x "
                     f"[{iqr['guard'][0]:.2f}, {iqr['guard'][1]:.2f}]) | "
                     f"{m['guard_snap'] * 1e3:.2f} ms ({q['guard_snap']:.2f}x [{iqr['guard_snap'][0]:.2f}, "
                     f"{iqr['guard_snap'][1]:.2f}]) | "
                     + (f"{m['guard_sync'] * 1e3:.2f} ms ({q['guard_sync']:.2f}x [{iqr['guard_sync'][0]:.2f}, "
                        f"{iqr['guard_sync'][1]:.2f}])" if "guard_sync" in m else "-")
                     + f" | {r['collective_s'] * 1e6:.0f} us "
                     f"({r['packed_floats']} floats) | {r['snapshot_s_per_rank'] * 1e3:.2f} ms, "
                     f"{r['snapshot_bytes_per_rank'] / 2**20:.2f} MiB |")
    with open(os.path.join(args.out, name + ".md"), "w") as fh:
        fh.write("\n".join(lines) + "\n")
    print("\n".join(lines))


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--backend", choices=["gloo", "nccl"], default="gloo")
    ap.add_argument("--nproc", type=int, default=0, help="processes (default: 2 for gloo, every GPU for nccl)")
    import importlib.util

    default = ["ddp", "zero", "fsdp2", "fsdp1"] + (["deepspeed"] if importlib.util.find_spec("deepspeed") else [])
    ap.add_argument("--strategies", nargs="+", default=default,
                    choices=["ddp", "zero", "fsdp2", "fsdp1", "deepspeed"])
    ap.add_argument("--width", type=int, default=256)
    ap.add_argument("--depth", type=int, default=8)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--steps", type=int, default=15, help="measured steps per arm and round")
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--reps", type=int, default=200, help="repetitions of the bare all-reduce")
    ap.add_argument("--threads", type=int, default=1, help="intra-op threads per process (CPU)")
    ap.add_argument("--out", default=RESULTS_DIR)
    args = ap.parse_args(argv)
    if "deepspeed" in args.strategies:
        os.environ.setdefault("DS_ACCELERATOR", "cuda" if args.backend == "nccl" else "cpu")
    world = args.nproc or (torch.cuda.device_count() if args.backend == "nccl" else 2)
    if args.backend == "nccl" and world < 1:
        raise SystemExit("--backend nccl needs at least one GPU")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    torch.multiprocessing.spawn(worker, args=(world, args, port), nprocs=world, join=True)


if __name__ == "__main__":
    main()
