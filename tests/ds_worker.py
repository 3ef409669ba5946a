"""Worker for tests/test_deepspeed.py: one rank of a CPU (gloo) DeepSpeed ZeRO run in a plain loop,
``gradguard.deepspeed.DeepSpeedGuard(engine)`` in place of ``engine.step()``. Faults on rank 1 only: a NaN loss at step 4 (the
engine's overflow check skips it), a garbage-label window with a loss spike at steps 6-7. Writes
what this rank saw to ``<out>/rank<R>.json``.

usage: python -m torch.distributed.run --nproc_per_node N tests/ds_worker.py OUT STAGE SCENARIO

SCENARIO: ``faults`` (the above, AdamW; ``bf16``: the same in bf16, ``offload``: the same with the
optimizer offloaded), ``lr`` / ``lr1`` (SGD; ``lr``: the LR multiplier set to 0.5
by hand at step 3, so that step's update is half of ``lr1``'s; both: the clip tightened by hand at
step 5), ``gas`` (two micro-batches per step: gradient_accumulation_steps=2), ``resume`` (faults, then at step 9 a new engine and
guard from rank 0's saved states), ``refused`` (construction only).
"""

from __future__ import annotations

import json
import os
import sys

os.environ.setdefault("DS_ACCELERATOR", "cpu")
os.environ.setdefault("DS_BUILD_OPS", "0")

import deepspeed  # noqa: E402
import torch  # noqa: E402
from torch import nn  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import gradguard as gg  # noqa: E402
from gradguard.deepspeed import DeepSpeedGuard  # noqa: E402
from gradguard.measure import default_layer_name  # noqa: E402
from tests._dist import shutdown  # noqa: E402
from tests.plain_dist_worker import BATCH, MLP, batch  # noqa: E402  (the model and data of the DDP/FSDP tests)

STEPS = 14


def build(stage: int, scenario: str, out: str) -> tuple[object, gg.Guard]:
    torch.manual_seed(0)
    model = MLP()
    if scenario.startswith("lr"):
        opt: torch.optim.Optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    else:
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    zero: dict = {"stage": stage}
    extra: dict = {}
    if scenario == "offload":  # the optimizer on the host: the partition is not readable before the step
        zero["offload_optimizer"] = {"device": "cpu"}
        extra = {"zero_force_ds_cpu_optimizer": False}
    if scenario == "bf16":
        extra["bf16"] = {"enabled": True}
    if scenario == "fp16":
        extra["fp16"] = {"enabled": True, "initial_scale_power": 8, "loss_scale_window": 1000}
    gas = 2 if scenario == "gas" else 1  # gas: each rank's batch in two micro-batches of half the size
    ds_config = {"train_micro_batch_size_per_gpu": BATCH // gas, "gradient_accumulation_steps": gas,
                 "gradient_clipping": 1.0, "zero_optimization": zero, "steps_per_print": 10**9,
                 "zero_allow_untested_optimizer": True, **extra}
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=opt, config=ds_config)
    conf = gg.GuardConfig.preset("default", output={"console": False, "dir": out},
                                 # the 2-batch spike window escalates at its second spike, as the rollback checks want
                                 policy={"ladder": [["rollback", "lower_lr"]], "ambiguous_spikes": False},
                                 recovery={"snapshot_interval": 2, "confirm_steps": 1}, detect={"warmup_steps": 3})
    if scenario == "monitor":  # watching only: DeepSpeed clips and skips as configured
        conf = gg.GuardConfig.preset("monitor", output={"console": False, "dir": out}, detect={"warmup_steps": 3})
    if scenario == "wrong":  # the module and DeepSpeed's optimizer, not the engine
        return engine, gg.Guard(engine.module, engine.optimizer, config=conf)
    return engine, DeepSpeedGuard(engine, config=conf)


def reference_norms(world: int) -> dict[str, float]:
    """Per-layer gradient norms of the same model at step 1 in one process, on every rank's batch
    (ZeRO averages the ranks' gradients: the gradient of the mean loss over the joined batch)."""
    torch.manual_seed(0)
    model = MLP()
    xs, ys = zip(*(batch(1, r) for r in range(world)))
    nn.functional.cross_entropy(model(torch.cat(xs)), torch.cat(ys)).backward()
    sq: dict[str, float] = {}
    for name, p in model.named_parameters():
        layer = default_layer_name(name)
        sq[layer] = sq.get(layer, 0.0) + float(p.grad.double().pow(2).sum())
    return {k: v ** 0.5 for k, v in sq.items()}


def flat_params(module: nn.Module) -> list[float]:
    return [round(float(v), 7) for p in module.parameters() for v in p.detach().flatten()]


def main(out: str, stage_s: str, scenario: str) -> None:
    torch.set_num_threads(1)
    deepspeed.init_distributed(dist_backend="gloo")
    rank = torch.distributed.get_rank()
    stage = int(stage_s)
    try:
        engine, guard = build(stage, scenario, out)
    except gg.UnsupportedSetupError as exc:
        with open(os.path.join(out, f"rank{rank}.json"), "w") as fh:
            json.dump({"rank": rank, "refused": str(exc)}, fh)
        return
    res: dict = {"rank": rank, "engine_class": type(guard).__name__, "ref": reference_norms(torch.distributed.get_world_size()),
                 "engine_clip_at_attach": engine.optimizer.clip_grad, "max_norm_at_attach": guard.core.clip.max_norm}
    after: dict[int, list[float]] = {0: flat_params(engine.module)}
    reports = []
    restored = []
    for step in range(1, STEPS + 1):
        x, y = batch(step, rank)
        faults = scenario in ("faults", "resume", "offload", "bf16", "fp16", "monitor")
        if faults and rank == 1 and step in (6, 7):
            y = torch.randint(0, 5, y.shape, generator=torch.Generator().manual_seed(step))
            x = x * 300
        if scenario == "lr" and step == 3:
            guard.core.lr.global_mult = 0.5
        if scenario.startswith("lr") and step == 5:
            guard.core.clip.tighten()
        before = flat_params(engine.module)
        dtype = next(engine.module.parameters()).dtype
        if scenario == "gas":  # the first half as its own micro-batch: guard.step steps the engine's micro count
            half = BATCH // 2
            first = nn.functional.cross_entropy(engine(x[:half]), y[:half])
            engine.backward(first)
            res.setdefault("micro_returns", []).append(guard.step(first))
            res.setdefault("micro_losses", []).append(float(first))
            x, y = x[half:], y[half:]
        loss = nn.functional.cross_entropy(engine(x.to(dtype)).float(), y)
        if faults and rank == 1 and step in (6, 7):
            loss = loss * 50
        if faults and rank == 1 and step == 4:
            loss = loss * float("nan")
        if scenario == "gas":
            res.setdefault("micro_losses2", []).append(float(loss))
        engine.backward(loss)
        lr_seen = [g["lr"] for g in engine.optimizer.param_groups]
        scale_before = getattr(getattr(engine.optimizer, "loss_scaler", None), "cur_scale", None)
        r = guard.step(loss)
        reports.append(r)
        res.setdefault("scales", []).append([scale_before, r.scale])
        now = flat_params(engine.module)
        if scenario.startswith("lr") and step == 3:
            res["delta"] = [a - b for a, b in zip(now, before)]
            res["lr_after_step"] = [g["lr"] for g in engine.optimizer.param_groups]
            res["lr_before_step"] = lr_seen
        if scenario.startswith("lr") and step == 5:
            res["clip_after_tighten"] = [guard.core.clip.max_norm, engine.optimizer.clip_grad]
        for a in r.actions:
            if a.name == "rollback" and "to_step" in a.params:
                # the weights now are exactly those right after step to_step; the fp32 master partition too
                to = a.params["to_step"]
                restored.append([step, to, now == after[to]])
                zero = engine.optimizer
                pid = torch.distributed.get_rank(group=zero.real_dp_process_group[0])
                master = zero.single_partition_of_fp32_groups[0]
                bit16 = zero.parallel_partitioned_bit16_groups[0][pid]  # bf16: the master rounded
                res.setdefault("master_matches", []).append(
                    bool(torch.equal(master.to(bit16.dtype), bit16)))
        after[step] = now
        if scenario == "resume" and step == 9:
            box = [guard.state_dict()]
            torch.distributed.broadcast_object_list(box, src=0)
            guard.close()
            engine2, guard2 = build(stage, scenario, out)
            guard2.load_state_dict(box[0])
            # everything but the output settings (only rank 0 writes the event log)
            res["resumed_equal"] = [k for k in box[0] if k != "config" and guard2.state_dict().get(k) != box[0][k]]
            engine, guard = engine2, guard2
            after = {0: flat_params(engine.module)}  # the new engine starts over from the same weights
    res.update({
        "actions": [[r.step, a.name, a.params.get("to_step"), a.params.get("replaces")] for r in reports for a in r.actions],
        "skipped": [r.step for r in reports if r.skipped], "norms": reports[0].layer_norms,
        "overflow": [r.step for r in reports if r.overflow],
        "findings": [[r.step, f.kind] for r in reports for f in r.findings],
        "losses": [r.loss for r in reports], "totals": [r.total_norm for r in reports],
        "engine_norms": [float(engine.get_global_grad_norm() or 0.0)],
        "restored": restored, "mult": guard.core.lr.global_mult, "engine_clip": engine.optimizer.clip_grad,
        "guard_clip": guard.core.clip.max_norm, "params": flat_params(engine.module),
        "log": guard.log_path,
    })
    events = [json.loads(line) for line in open(guard.log_path)] if guard.log_path and rank == 0 else []
    res["engine_events"] = [e for e in events if e["type"] == "engine"]
    guard.close()
    res["engine_clip_after_close"] = engine.optimizer.clip_grad
    with open(os.path.join(out, f"rank{rank}.json"), "w") as fh:
        json.dump(res, fh)


if __name__ == "__main__":
    main(*sys.argv[1:4])
    shutdown()
