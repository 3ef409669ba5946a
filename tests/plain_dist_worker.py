"""Worker for tests/test_scale.py: one rank of a 2-process CPU (gloo) plain-loop run, ``gg.Guard``
on a DDP / FSDP2 / FSDP1 model (fsdp1_orig: ``use_orig_params=True``; fsdp1: flat
parameters, one unit per Linear; fsdp1_one: one flat parameter for the whole model; zero: DDP with
the optimizer state sharded by ``ZeroRedundancyOptimizer``; tp: tensor parallelism, layers.0
column-wise and layers.1 row-wise, every rank on the same batch). Faults exist on rank 1 only. Writes what this rank saw to
``<out>/rank<R>.json``.

usage: python -m torch.distributed.run --nproc_per_node 2 tests/plain_dist_worker.py OUT STRATEGY SCENARIO
"""

from __future__ import annotations

import hashlib
import json
import os
import sys

import torch
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import gradguard as gg  # noqa: E402
from gradguard.measure import default_layer_name  # noqa: E402
from tests._dist import shutdown  # noqa: E402

STEPS = 12
BATCH = 8  # per rank


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(12, 32), nn.Linear(32, 32), nn.Linear(32, 5)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i, layer in enumerate(self.layers):
            x = layer(x)
            if i < len(self.layers) - 1:
                x = torch.tanh(x)
        return x


def batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randn(BATCH, 12, generator=g)
    y = (x[:, :5].argmax(dim=1) + step % 2) % 5  # learnable labels
    return x, y


def wrap(model: nn.Module, strategy: str) -> nn.Module:
    if strategy in ("ddp", "zero"):
        return nn.parallel.DistributedDataParallel(model)
    if strategy in ("fsdp2", "hsdp"):
        from torch.distributed.fsdp import fully_shard

        mesh = None
        if strategy == "hsdp":  # hybrid sharding: 2 replicas x 2 shards, a 2-D device mesh
            from torch.distributed.device_mesh import init_device_mesh

            mesh = init_device_mesh("cpu", (2, torch.distributed.get_world_size() // 2),
                                    mesh_dim_names=("replicate", "shard"))
        for layer in model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        return model
    if strategy == "fsdp1_hsdp":  # FSDP1 HYBRID_SHARD with flat parameters: 2 replicas x 2 shards
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
        from torch.distributed.fsdp import ShardingStrategy
        from torch.distributed.fsdp.wrap import ModuleWrapPolicy

        mesh = init_device_mesh("cpu", (2, torch.distributed.get_world_size() // 2),
                                mesh_dim_names=("replicate", "shard"))
        return FSDP(model, auto_wrap_policy=ModuleWrapPolicy({nn.Linear}), device_mesh=mesh,
                    sharding_strategy=ShardingStrategy.HYBRID_SHARD, device_id=torch.device("cpu"))
    if strategy == "fsdp_tp":  # 2-D, as torchtitan: tensor parallel inside pairs of ranks, FSDP2 across them
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

        mesh = init_device_mesh("cpu", (torch.distributed.get_world_size() // 2, 2), mesh_dim_names=("dp", "tp"))
        parallelize_module(model, mesh["tp"], {"layers.0": ColwiseParallel(), "layers.1": RowwiseParallel()})
        for layer in model.layers:
            fully_shard(layer, mesh=mesh["dp"])
        fully_shard(model, mesh=mesh["dp"])
        return model
    if strategy == "tp":  # tensor parallelism: layers.0 column-wise, layers.1 row-wise (DTensor shards)
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

        mesh = init_device_mesh("cpu", (torch.distributed.get_world_size(),))
        return parallelize_module(model, mesh, {"layers.0": ColwiseParallel(), "layers.1": RowwiseParallel()})
    if strategy in ("fsdp1", "fsdp1_orig", "fsdp1_one"):
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
        from torch.distributed.fsdp.wrap import ModuleWrapPolicy

        # fsdp1_one: one flat parameter for the whole model, its shard boundary inside a layer's weight
        policy = None if strategy == "fsdp1_one" else ModuleWrapPolicy({nn.Linear})
        return FSDP(model, auto_wrap_policy=policy, use_orig_params=strategy == "fsdp1_orig",
                    device_id=torch.device("cpu"))  # FSDP1 on the CPU (gloo)
    raise SystemExit(f"unknown strategy {strategy}")


def reference_norms(seed_model: nn.Module, ranks: list[int]) -> dict[str, float]:
    """Step 1's per-layer gradient norms of the same model on the batches of ``ranks`` together, in one process."""
    ref = MLP()
    ref.load_state_dict(seed_model.state_dict())
    xs, ys = zip(*(batch(1, r) for r in ranks))
    nn.functional.cross_entropy(ref(torch.cat(xs)), torch.cat(ys)).backward()
    sq: dict[str, float] = {}
    for name, p in ref.named_parameters():
        layer = default_layer_name(name)
        sq[layer] = sq.get(layer, 0.0) + float(p.grad.double().square().sum())
    return {k: v ** 0.5 for k, v in sq.items()}


def full_params(model: nn.Module) -> list[float]:
    """Every parameter, gathered (sharded strategies) in a fixed order."""
    out: list[float] = []
    from torch.distributed.tensor import DTensor

    if isinstance(model, torch.distributed.fsdp.FullyShardedDataParallel):
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

        with FSDP.summon_full_params(model):
            for p in model.parameters():
                out.extend(p.detach().reshape(-1).tolist())
        return out
    for p in model.parameters():
        t = p.detach()
        if isinstance(t, DTensor):
            t = t.full_tensor()
        out.extend(t.reshape(-1).tolist())
    return out


def main(out: str, strategy: str, scenario: str) -> None:
    if os.environ.get("GG_DUMP"):  # diagnosing a hang: every thread's stack after GG_DUMP seconds
        import faulthandler

        faulthandler.dump_traceback_later(float(os.environ["GG_DUMP"]), exit=True)
    torch.set_num_threads(1)
    if not torch.distributed.is_initialized():  # one process group for every run of the launch
        torch.distributed.init_process_group("gloo")
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    torch.manual_seed(0)
    base = MLP()
    # tensor parallelism: the ranks of a tensor-parallel group compute on the same batch (tp: rank 0's;
    # fsdp_tp: each data-parallel pair on its first rank's)
    data_rank = {"tp": 0, "fsdp_tp": rank - rank % 2}.get(strategy, rank)
    ref_ranks = {"tp": [0], "fsdp_tp": list(range(0, world, 2))}.get(strategy, list(range(world)))
    ref = reference_norms(base, ref_ranks)
    model = wrap(base, strategy)
    if strategy == "zero":  # ZeRO-1: DDP with the optimizer state sharded (torch's ZeroRedundancyOptimizer)
        from torch.distributed.optim import ZeroRedundancyOptimizer

        opt = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.AdamW, lr=1e-2)
    else:
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ladder = [["tighten_clip", "adam"]] if scenario == "clip" else [["rollback", "lower_lr"]]
    recovery: dict = {"snapshot_interval": 2, "confirm_steps": 1}
    if scenario in ("disk", "disk_damaged"):
        recovery["disk_dir"] = os.path.join(out, "snaps")
        ladder = [["rollback"]]
    over: dict = {}
    if scenario == "clip":  # clipping on healthy steps, with the global norm
        over["clip"] = {"max_norm": 0.4, "floor": 0.1}
    if strategy in ("tp", "fsdp_tp"):  # parameter norms and update ratios (DTensor and plain parameters) every 3 steps
        over["measure"] = {"log_interval": 3}
    # the 2-batch spike window escalates at its second spike, as the rollback checks want
    # (``ambiguous``: a 3-batch window held as ambiguous: a rollback without a cut, a return on trial)
    conf = gg.GuardConfig.preset("default", output={"console": False, "dir": out},
                                 policy={"ladder": ladder, "ambiguous_spikes": scenario == "ambiguous"},
                                 recovery=recovery, detect={"warmup_steps": 3}, **over)
    if scenario == "monitor_clip":  # a watching guard applying the user's fixed clip; no faults
        conf = gg.GuardConfig.preset("monitor", output={"console": False, "dir": out},
                                     clip={"mode": "fixed", "max_norm": 0.2})
    try:
        guard = gg.Guard(model, opt, config=conf)
    except gg.UnsupportedSetupError as exc:  # refused at attach, on every rank alike
        with open(os.path.join(out, f"rank{rank}.json"), "w") as fh:
            json.dump({"rank": rank, "refused": str(exc)}, fh)
        return
    resume = scenario == "resume"
    reports = []
    disk_files: list[str] = []
    for step in range(1, STEPS + 1):
        x, y = batch(step, data_rank)
        faults = scenario != "monitor_clip"
        window = (6, 7, 8) if scenario == "ambiguous" else (6, 7)
        if faults and rank == 1 and step in window:
            y = torch.randint(0, 5, y.shape, generator=torch.Generator().manual_seed(step))  # garbage labels
            x = x * 300
        loss = nn.functional.cross_entropy(model(x), y)
        if faults and rank == 1 and step in window:
            loss = loss * 50  # the garbage window's loss spike, on rank 1 only
        if faults and rank == 1 and step == 4:
            loss = loss * float("nan")  # a NaN in rank 1's batch only
        loss.backward()
        if scenario == "disk_damaged" and rank == 1 and step == 7:  # rank 1's newest snapshot file damaged
            path = guard.core.snapshots.disk.path(2)
            with open(path, "r+b") as fh:
                fh.truncate(100)
        if scenario == "clip" and step == 3:  # the middle layer's LR x0.1 (under fsdp1_one: a slice of the flat parameter)
            guard.core.lr.lower_layers(["layers.1"])
        r = guard.step(loss)
        opt.zero_grad(set_to_none=True)
        reports.append(r)
        if scenario.startswith("disk") and guard.core.snapshots is not None and guard.core.snapshots.disk is not None:
            d = guard.core.snapshots.disk.directory
            disk_files = [os.path.join(os.path.basename(d), f) for f in sorted(os.listdir(d))] or disk_files
        if resume and step == 8:  # a new guard from rank 0's state on every rank, as after a restart
            box = [guard.state_dict()]
            torch.distributed.broadcast_object_list(box, src=0)
            state = box[0]
            guard.close()
            guard = gg.Guard(model, opt, config=conf)
            guard.load_state_dict(state)
    events = [json.loads(line) for line in open(guard.log_path)] if guard.log_path and rank == 0 else []
    fallbacks = [e for e in events if e["type"] == "snapshot_fallback"]
    ratio_steps = [e["step"] for e in events if e["type"] == "metrics"
                   and any(k.startswith("gradguard/update_ratio/") for k in e)]
    digest = hashlib.sha256(json.dumps(full_params(model)).encode()).hexdigest()
    first = reports[0]
    res = {"rank": rank, "world": world, "strategy": strategy,
           "actions": [[r.step, a.name, a.params.get("to_step")] for r in reports for a in r.actions],
           "skipped": [r.step for r in reports if r.skipped],
           "clipped": [r.step for r in reports if r.clipped],
           "findings": [[r.step, f.kind] for r in reports for f in r.findings],
           "norms": first.layer_norms, "total": first.total_norm, "ref": ref,
           "losses": [r.loss for r in reports], "totals": [r.total_norm for r in reports], "mult": guard.core.lr.global_mult, "layer_mult": dict(guard.core.lr.layer_mult), "max_norm": guard.core.clip.max_norm,
           "steps": guard.core.step_count, "weights": digest, "params": full_params(model),
           "betas": [list(g["betas"]) for g in opt.param_groups], "disk_files": disk_files,
           "pid": os.getpid(), "fallbacks": fallbacks, "ratio_steps": ratio_steps,
           "engine_norms": [r.engine_norm for r in reports], "log": guard.log_path}
    guard.close()
    with open(os.path.join(out, f"rank{rank}.json"), "w") as fh:
        json.dump(res, fh)


if __name__ == "__main__":
    import gc

    for i in range(1, len(sys.argv), 3):  # OUT STRATEGY SCENARIO [OUT STRATEGY SCENARIO ...]: runs in one launch
        main(*sys.argv[i:i + 3])
        gc.collect()
    shutdown()
