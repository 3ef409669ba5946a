"""Worker for tests/test_scale_engines.py: one rank of a 2-process CPU (gloo) ``lightning.Trainer`` run
with ``GradGuardCallback`` under ``strategy="ddp"``, ``ModelParallelStrategy`` (FSDP2: ``fully_shard``
in ``configure_model``) or ``FSDPStrategy`` (FSDP1: ``fsdp``, units wrapped in ``configure_model``;
``fsdp_root``, one root unit around the LightningModule, as ``FSDPStrategy`` wraps without an
``auto_wrap_policy``). Faults exist on rank 1 only (a NaN loss at step 4, a loss spike at steps
6-7: a rollback skips one batch of data after it). Writes what this rank saw to
``<out>/rank<R>.json``.

``FSDPStrategy`` on the CPU: Lightning refuses ``FSDPStrategy`` with ``accelerator="cpu"`` (its
accelerator connector checks ``type(strategy) is FSDPStrategy``) and wraps with
``device_id=root_device.index`` (None on the CPU, which FSDP1 refuses without an accelerator). The
test therefore uses a subclass (the type check differs, and ``fsdp_root`` wraps with
``device_id=cpu``) or wraps the network itself in ``configure_model`` with ``device_id=cpu``
(Lightning then leaves the wrapping alone): everything
else (process group, optimizer setup, clipping, checkpoint saving and loading) is Lightning's.
Checkpoints are saved with ``state_dict_type="sharded"``: torch's FSDP1 full-state-dict gather
crashes (SIGSEGV) on the CPU here, with or without gradguard.

usage: python -m torch.distributed.run --nproc_per_node 2 tests/lightning_shard_worker.py OUT STRATEGY SCENARIO
[OUT STRATEGY SCENARIO ...] (several runs one after the other in one launch, each into its own OUT)
"""

from __future__ import annotations

import json
import os
import sys

import torch
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import lightning.pytorch as L  # noqa: E402
from lightning.pytorch.strategies import FSDPStrategy, ModelParallelStrategy  # noqa: E402

import gradguard as gg  # noqa: E402
from gradguard.lightning import GradGuardCallback  # noqa: E402
from gradguard.measure import default_layer_name  # noqa: E402
from tests._dist import shutdown  # noqa: E402
from tests.plain_dist_worker import MLP  # noqa: E402

BATCH = 8  # per rank
N = 2 * BATCH * 12


def data() -> torch.utils.data.TensorDataset:
    g = torch.Generator().manual_seed(7)
    x = torch.randn(N, 12, generator=g)
    y = x[:, :5].argmax(dim=1)
    return torch.utils.data.TensorDataset(x, y)


def reference_norms(seed_state: dict, batches: list) -> dict[str, float]:
    """Step 1's per-layer gradient norms of the same network on every rank's first batch, in one process."""
    ref = MLP()
    ref.load_state_dict(seed_state)
    x, y = torch.cat([b[0] for b in batches]), torch.cat([b[1] for b in batches])
    nn.functional.cross_entropy(ref(x), y).backward()
    sq: dict[str, float] = {}
    for name, p in ref.named_parameters():
        layer = "net." + default_layer_name(name)
        sq[layer] = sq.get(layer, 0.0) + float(p.grad.double().square().sum())
    return {k: v ** 0.5 for k, v in sq.items()}


class CpuFSDPStrategy(FSDPStrategy):
    """``FSDPStrategy`` past Lightning's GPU-only check (see the module docstring)."""

    def __init__(self, *args, root: bool = False, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.root = root

    def _setup_model(self, model):
        if not self.root:  # the network was wrapped in configure_model: Lightning leaves it
            return super()._setup_model(model)
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

        # as FSDPStrategy wraps the whole LightningModule (one root unit: no auto_wrap_policy), with
        # the device_id FSDP1 needs on the CPU
        return FSDP(module=model, device_id=torch.device("cpu"), sharding_strategy=self.sharding_strategy, **self.kwargs)


class Lit(L.LightningModule):
    def __init__(self, strategy: str) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = MLP()
        self.kind = strategy

    def configure_model(self) -> None:
        if self.kind == "model_parallel_tp":  # tensor parallelism over both ranks (every rank on the same batch)
            from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

            parallelize_module(self.net, self.device_mesh["tensor_parallel"],
                               {"layers.0": ColwiseParallel(), "layers.1": RowwiseParallel()})
        elif self.kind == "model_parallel":
            from torch.distributed.fsdp import fully_shard

            mesh = self.device_mesh["data_parallel"]
            for layer in self.net.layers:
                fully_shard(layer, mesh=mesh)
            fully_shard(self.net, mesh=mesh)
        elif self.kind in ("fsdp", "fsdp_flat") and not isinstance(self.net, torch.distributed.fsdp.FullyShardedDataParallel):
            from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
            from torch.distributed.fsdp.wrap import ModuleWrapPolicy

            self.net = FSDP(self.net, auto_wrap_policy=ModuleWrapPolicy({nn.Linear}), device_id=torch.device("cpu"),
                            use_orig_params=self.kind == "fsdp")

    def training_step(self, batch, batch_idx):
        x, y = batch
        if self.trainer.global_step == 0:
            self.first_batch = (x.clone(), y.clone())
        loss = nn.functional.cross_entropy(self.net(x), y)
        step = self.trainer.global_step + 1
        if SCENARIO.startswith("oom"):
            return loss
        if self.global_rank == 1 and step in (6, 7):
            loss = loss * 50  # a loss spike on rank 1 only
        if self.global_rank == 1 and step == 4:
            loss = loss * float("nan")  # a NaN in rank 1's batch only
        return loss

    def configure_optimizers(self):
        if self.kind == "ddp_zero":  # ZeRO-1: the optimizer state sharded over the ranks
            from torch.distributed.optim import ZeroRedundancyOptimizer

            return ZeroRedundancyOptimizer(self.parameters(), optimizer_class=torch.optim.AdamW, lr=1e-2)
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


def gathered(module: Lit, root: nn.Module) -> list[float]:
    """Every parameter of the network, unsharded, in a fixed order (``root``: the strategy's model)."""
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.tensor import DTensor

    out: list[float] = []
    if any(isinstance(m, FSDP) for m in root.modules()):
        with FSDP.summon_full_params(root):
            for p in module.net.parameters():
                out.extend(p.detach().reshape(-1).tolist())
        return out
    for p in module.net.parameters():
        t = p.detach()
        out.extend((t.full_tensor() if isinstance(t, DTensor) else t).reshape(-1).tolist())
    return out


SCENARIO = ""


def main(out: str, strategy: str, scenario: str) -> None:
    global SCENARIO
    SCENARIO = scenario
    torch.set_num_threads(1)
    from lightning.pytorch.callbacks import ModelCheckpoint

    module = Lit(strategy)
    seed = {k: v.clone() for k, v in module.net.state_dict().items()}
    # the 2-batch spike window escalates at its second spike, as the rollback checks want
    conf = gg.GuardConfig.preset("default", output={"console": False, "dir": out},
                                 policy={"ladder": [["rollback", "lower_lr"]], "ambiguous_spikes": False},
                                 recovery={"snapshot_interval": 2, "confirm_steps": 1,
                                           "skip_batches": 1},
                                 detect={"warmup_steps": 3}, clip={"max_norm": 0.3, "floor": 0.1})
    if scenario.startswith("oom"):
        # oom: from step 3 rank 1 cannot fit more than 4 samples in a forward (recovery.oom_all_ranks);
        # oom_clean: no error, the same setting; oom_native: no error, DDP's own gradient sync
        conf = gg.GuardConfig.preset("default", output={"console": False, "dir": out}, detect={"warmup_steps": 3},
                                     recovery={"snapshot_interval": 0, "oom_all_ranks": scenario != "oom_native"})
        rank_ = int(os.environ["RANK"])

        def too_big(mod, args):
            if scenario == "oom" and rank_ == 1 and mod.training and module.trainer.global_step + 1 >= 3 \
                    and args[0].shape[0] > 4:
                raise torch.OutOfMemoryError(f"CUDA out of memory (injected: {args[0].shape[0]} samples on rank 1)")

        module.net.layers[1].register_forward_pre_hook(too_big)
    records: list[dict] = []
    restored: dict = {}
    batch_sizes: list[int] = []

    class Rec(L.Callback):
        def on_train_start(self, trainer, pl_module):
            core = cb.core
            if core is not None:
                restored.update(steps=core.step_count, mult=core.lr.global_mult, clip=core.clip.max_norm,
                                actions=dict(core.action_counts))

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            batch_sizes.append(int(batch[0].shape[0]))
            r = cb.last_report
            if r is None or (records and records[-1]["step"] == r.step):
                return
            records.append({"step": r.step, "actions": [[a.name, a.params.get("to_step")] for a in r.actions],
                            "skipped": bool(r.skipped), "clipped": bool(r.clipped), "findings": [f.kind for f in r.findings],
                            "loss": r.loss, "total": r.total_norm, "norms": r.layer_norms})

    def trainer(steps: int, extra: list) -> L.Trainer:
        if strategy in ("ddp", "ddp_zero"):
            st: object = "ddp"
        elif strategy == "model_parallel":
            st = ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1)
        elif strategy == "model_parallel_tp":
            st = ModelParallelStrategy(data_parallel_size=1, tensor_parallel_size=2)
        else:
            # fsdp_root_flat: the root unit with flat parameters (use_orig_params=False)
            flat = {"use_orig_params": False} if strategy == "fsdp_root_flat" else {}
            st = CpuFSDPStrategy(state_dict_type="sharded", root=strategy.startswith("fsdp_root"), **flat)
        return L.Trainer(accelerator="cpu", devices=2, strategy=st, max_steps=steps, callbacks=[cb, Rec(), *extra],
                         logger=False, enable_progress_bar=False, enable_model_summary=False,
                         enable_checkpointing=bool(extra), default_root_dir=out, use_distributed_sampler=False)

    # the same samples per rank under every strategy (ModelParallelStrategy's sampler orders them otherwise)
    tp = strategy == "model_parallel_tp"  # one tensor-parallel group: both ranks read rank 0's samples
    sampler = torch.utils.data.DistributedSampler(data(), num_replicas=1 if tp else 2,
                                                  rank=0 if tp else int(os.environ["RANK"]), shuffle=False)
    loader = torch.utils.data.DataLoader(data(), batch_size=BATCH, sampler=sampler)
    cb = GradGuardCallback(conf)
    res: dict = {}
    try:
        if scenario == "resume":  # 8 steps, a checkpoint, then a new Trainer and callback resume from it
            ckpt = ModelCheckpoint(dirpath=os.path.join(out, "ckpt"), every_n_train_steps=8, save_top_k=-1)
            t = trainer(8, [ckpt])
            t.fit(module, loader)
            res["before"] = {"steps": cb.core.step_count, "mult": cb.core.lr.global_mult,
                             "clip": cb.core.clip.max_norm, "actions": dict(cb.core.action_counts)}
            path = ckpt.best_model_path or ckpt.last_model_path
            res["ckpt"] = os.path.basename(path)
            cb = GradGuardCallback(conf)
            restored.clear()
            module = Lit(strategy)
            t = trainer(12, [])
            t.fit(module, loader, ckpt_path=path)
            res["restored"] = dict(restored)
        else:
            t = trainer(8 if scenario.startswith("oom") else 12, [])
            t.fit(module, loader)
    except gg.UnsupportedSetupError as exc:  # refused at attach, on every rank alike
        res = {"refused": str(exc)}
        rank = int(os.environ.get("RANK", "0"))
        with open(os.path.join(out, f"rank{rank}.json"), "w") as fh:
            json.dump({"rank": rank, **res}, fh)
        return
    core = cb.core
    rank = t.global_rank
    batches: list = [None, None]
    torch.distributed.all_gather_object(batches, getattr(module, "first_batch", None))
    ref = reference_norms(seed, batches) if batches[0] is not None else {}
    res.update({"rank": rank, "records": records, "ref": ref, "params": gathered(module, t.strategy.model),
                "mult": core.lr.global_mult, "clip": core.clip.max_norm, "steps": core.step_count,
                "actions": dict(core.action_counts), "skipped": core.skipped_steps,
                "sharded": core.measurer.sharding is not None,
                "action_log": [[e["step"], e["name"], e["params"]] for e in core.reporter.action_log],
                "batch_sizes": list(batch_sizes), "names": [n for n, _ in module.named_parameters()], "window": cb.data_skipped_steps,
                "log": core.log_path if rank == 0 else None})
    with open(os.path.join(out, f"rank{rank}.json"), "w") as fh:
        json.dump(res, fh)


if __name__ == "__main__":
    import gc

    for i in range(1, len(sys.argv), 3):  # one process group for every run of the launch
        main(*sys.argv[i:i + 3])
        gc.collect()
    shutdown()
