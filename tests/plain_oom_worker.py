"""Worker for tests/test_scale.py: one rank of a 2-process CPU (gloo) plain-loop run on a DDP model
through ``Guard.accumulate`` (a ``BatchController`` per rank), with out-of-memory errors injected
on rank 1 only. Writes what this rank saw to ``<out>/rank<R>.json``.

Scenarios: ``none`` (no error), ``oom`` (from step 3 rank 1 cannot fit more than 3 samples in a
forward), ``oom_single`` (at step 3 rank 1 cannot fit even one sample), ``shrink`` (a loss spike on
rank 1 at steps 5-6 with the ``shrink_batch`` rung: every rank halves its global batch).

usage: python -m torch.distributed.run --nproc_per_node 2 tests/plain_oom_worker.py OUT ddp SCENARIO
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
from gradguard.data import BatchController  # noqa: E402
from gradguard.measure import default_layer_name  # noqa: E402
from tests._dist import shutdown  # noqa: E402

STEPS = 8
BATCH = 8  # per rank and step


class MLP(nn.Module):
    """Three layers and a buffer (DDP broadcasts rank 0's buffers at the step's first forward)."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(12, 32), nn.Linear(32, 32), nn.Linear(32, 5)])
        self.register_buffer("gain", torch.ones(1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x * self.gain
        for i, layer in enumerate(self.layers):
            x = layer(x)
            if i < len(self.layers) - 1:
                x = torch.tanh(x)
        return x


def samples(rank: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(77 + rank)
    x = torch.randn(STEPS * BATCH, 12, generator=g)
    y = x[:, :5].argmax(dim=1)
    return [(x[i], y[i]) for i in range(len(x))]


def main(out: str, strategy: str, scenario: str) -> None:
    assert strategy == "ddp"
    torch.set_num_threads(1)
    if not torch.distributed.is_initialized():  # one process group for every run of the launch
        torch.distributed.init_process_group("gloo")
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    torch.manual_seed(0)
    base = MLP()
    if rank == 1:
        base.gain.fill_(3.0)  # DDP puts rank 0's buffer on every rank
    start = {k: v.clone() for k, v in base.state_dict().items()}
    model = nn.parallel.DistributedDataParallel(base)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ctl = BatchController(samples(rank), BATCH, shuffle=False)
    # shrink: the 2-step spike escalates at its second step (ambiguous_spikes off)
    over: dict = {"policy": {"ladder": [["shrink_batch"]], "ambiguous_spikes": False},
                  "recovery": {"snapshot_interval": 0}} if scenario == "shrink" else {}
    conf = gg.GuardConfig.preset("default", output={"console": False, "dir": out}, detect={"warmup_steps": 3},
                                 **over)
    guard = gg.Guard(model, opt, config=conf, batches=ctl)
    state = {"step": 0}

    def too_big(module: nn.Module, args: tuple) -> None:
        n = args[0].shape[0]
        if rank == 1 and scenario == "oom" and state["step"] >= 3 and n > 3:
            raise torch.OutOfMemoryError(f"CUDA out of memory (injected: {n} samples on rank 1)")
        if rank == 1 and scenario == "oom_single" and state["step"] == 3:
            raise torch.OutOfMemoryError(f"CUDA out of memory (injected: {n} samples on rank 1)")

    base.layers[1].register_forward_pre_hook(too_big)

    def loss_fn(mb: list[torch.Tensor]) -> torch.Tensor:
        x, y = mb
        loss = nn.functional.cross_entropy(model(x), y)
        if scenario == "shrink" and rank == 1 and state["step"] in (5, 6):
            loss = loss * 50  # a loss spike in rank 1's batches only
        return loss

    reports, error, micro, sizes = [], None, [], []
    for step, sb in enumerate(ctl, start=1):
        state["step"] = step
        try:
            guard.accumulate(sb, loss_fn)
        except torch.OutOfMemoryError as exc:
            error = [step, str(exc)]
            break
        r = guard.step()
        opt.zero_grad(set_to_none=True)
        reports.append(r)
        micro.append(ctl.micro_batch_size)
        sizes.append(len(sb))
    # step 1's per-layer norms of the same model on every rank's first batch, in one process
    ref_model = MLP()
    ref_model.load_state_dict(start)
    ref_model.gain.fill_(1.0)
    xs, ys = zip(*(torch.utils.data.default_collate(samples(r)[:BATCH]) for r in range(world)))
    nn.functional.cross_entropy(ref_model(torch.cat(xs)), torch.cat(ys)).backward()
    sq: dict[str, float] = {}
    for name, p in ref_model.named_parameters():
        sq[default_layer_name(name)] = sq.get(default_layer_name(name), 0.0) + float(p.grad.double().square().sum())
    params = [v for p in model.parameters() for v in p.detach().reshape(-1).tolist()]
    res = {"rank": rank, "error": error, "micro": micro, "sizes": sizes, "gain": float(base.gain),
           "actions": [[e["step"], e["name"], e["params"]] for e in guard.core.reporter.action_log],
           "oom_events": guard.oom.events,
           "skipped": [r.step for r in reports if r.skipped], "losses": [r.loss for r in reports],
           "norms": reports[0].layer_norms if reports else {}, "ref": {k: v ** 0.5 for k, v in sq.items()},
           "params": params, "weights": hashlib.sha256(json.dumps(params).encode()).hexdigest()}
    guard.close()
    with open(os.path.join(out, f"rank{rank}.json"), "w") as fh:
        json.dump(res, fh)


if __name__ == "__main__":
    import gc

    for i in range(1, len(sys.argv), 3):  # OUT STRATEGY SCENARIO [OUT STRATEGY SCENARIO ...]: runs in one launch
        main(*sys.argv[i:i + 3])
        gc.collect()
    shutdown()
