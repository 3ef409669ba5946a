"""Recovery mechanisms on real optimizers: batch controller, OOM retry, shrink/grow, disk tier,
and one real run with a corrupted data window."""

import copy
import json
import os
import signal
import subprocess
import sys
import textwrap

import pytest
import torch

import gradguard as gg
from gradguard.data import BatchController
from gradguard.snapshot import DiskSnapshots, SnapshotRing

from .conftest import TinyNet


class Pairs(torch.utils.data.Dataset):
    def __init__(self, n=64, t=6, vocab=32):
        g = torch.Generator().manual_seed(0)
        self.x = torch.randint(0, vocab, (n, t), generator=g)

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return {"x": self.x[i], "y": (self.x[i] + 1) % 32, "id": i}


def loss_of(model):
    return lambda mb: model(mb["x"], mb["y"])


def test_resizes_and_skips_never_drop_or_repeat_a_sample():
    ctl = BatchController(list(range(103)), batch_size=16, shuffle=True, seed=3, epochs=2)
    seen, skipped = [], []
    for i, step in enumerate(ctl):
        seen.extend(step.indices)
        assert sum(n for _, n in step.micro_batches()) == len(step)
        if i == 1:
            ctl.shrink_global()
        if i == 2:
            skipped.extend(sum(ctl.skip(2), []))
        if i == 4:
            ctl.shrink_micro()
        if i == 6:
            ctl.grow_global()
    everything = seen + skipped
    assert sorted(everything) == sorted(list(range(103)) * 2)
    assert ctl.skipped_indices and sum(ctl.skipped_indices, []) == skipped


def test_oom_halves_micro_batch_and_retries_same_data(quiet_cfg, tmp_path):
    torch.manual_seed(0)
    model, ref = TinyNet(), TinyNet()
    ref.load_state_dict(model.state_dict())

    def oom_above_4(mod, args):
        if args[0].shape[0] > 4:
            raise torch.OutOfMemoryError("CUDA out of memory (simulated on CPU)")

    model.embed.register_forward_pre_hook(oom_above_4)
    ds = Pairs()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ctl = BatchController(ds, batch_size=16, shuffle=False)
    sink = gg.sinks.MemorySink()
    guard = gg.Guard(model, opt, config=quiet_cfg(clip={"mode": "off"}), batches=ctl, sinks=[sink])
    first = next(iter(ctl))
    loss = guard.accumulate(first, loss_of(model))
    assert ctl.micro_batch_size == 4 and ctl.batch_size == 16 and ctl.accumulation_steps == 4
    assert guard.core.action_counts["oom_shrink_micro"] == 1  # one error, one action: 16 -> 4 (pieces of 8 failed too)
    act = next(e for e in sink.events if e["type"] == "action" and e["name"] == "oom_shrink_micro")
    assert act["params"]["micro_batch"] == [16, 4] and act["params"]["pieces"] == 4 and not act["params"]["step_skipped"]
    # same samples, same gradient as one full batch
    full = next(iter(BatchController(ds, batch_size=16, shuffle=False)))
    (mb, _), = list(full.micro_batches())
    ref_loss = ref(mb["x"], mb["y"])
    ref_loss.backward()
    assert loss == pytest.approx(ref_loss.item(), rel=1e-5)
    for p, q in zip(model.parameters(), ref.parameters()):
        assert torch.allclose(p.grad, q.grad, atol=1e-6)
    rep = guard.step()
    assert rep.applied and rep.step == 1 and rep.loss == pytest.approx(loss, rel=1e-6)
    # the new size survives a resume
    state = json.loads(json.dumps(guard.state_dict()))
    guard.close()
    ctl2 = BatchController(ds, batch_size=16, shuffle=False)
    guard2 = gg.Guard(model, opt, config=quiet_cfg(), batches=ctl2)
    guard2.load_state_dict(state)
    assert ctl2.micro_batch_size == 4 and guard2.core.step_count == 1 and ctl2.position == 16


def test_shrink_batch_scales_lr_and_grows_back_with_tight_clip(quiet_cfg):
    torch.manual_seed(0)
    model = TinyNet()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ctl = BatchController(Pairs(n=200), batch_size=16, epochs=None)
    cfg = quiet_cfg(recovery={"grow_after": 3, "grow_clip": 0.01, "grow_clip_steps": 2})
    guard = gg.Guard(model, opt, config=cfg, batches=ctl)
    seen_lr = []
    opt.register_step_pre_hook(lambda o, a, k: seen_lr.append(o.param_groups[0]["lr"]))
    a = gg.Action("shrink_batch", 1)
    guard.core.execute(a)
    assert a.params == {"batch": [16, 8], "lr_scale": 0.5}
    reports = []
    for step in ctl:
        guard.accumulate(step, loss_of(model))
        reports.append((len(step), guard.step()))
        opt.zero_grad()
        if len(reports) == 6:
            break
    sizes = [n for n, _ in reports]
    assert sizes[:3] == [8, 8, 8] and sizes[3:] == [16, 16, 16]  # grown back after 3 healthy steps
    assert seen_lr[:3] == pytest.approx([0.05] * 3) and seen_lr[3:] == pytest.approx([0.1] * 3)
    grow = [act for _, r in reports for act in r.actions if act.name == "grow_batch"]
    assert len(grow) == 1 and grow[0].params["clip_held"] == 0.01
    assert [r.clip_to for _, r in reports[3:5]] == [0.01, 0.01] and reports[5][1].clip_to == 1.0
    # micro mode keeps the global batch
    cfg_micro = quiet_cfg(recovery={"shrink_mode": "micro"})
    ctl2 = BatchController(Pairs(), batch_size=16)
    g2 = gg.Guard(model, torch.optim.SGD(model.parameters(), lr=0.1), config=cfg_micro, batches=ctl2)
    b = gg.Action("shrink_batch", 1)
    g2.core.execute(b)
    assert b.params == {"micro_batch": [16, 8], "accumulation": 2} and ctl2.batch_size == 16


def test_rollback_skips_data_window_and_logs_indices(quiet_cfg, tmp_path):
    torch.manual_seed(0)
    model = TinyNet()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ctl = BatchController(Pairs(), batch_size=4, shuffle=False, epochs=None)
    cfg = quiet_cfg(recovery={"snapshot_interval": 2, "confirm_steps": 1, "skip_batches": 3})
    guard = gg.Guard(model, opt, config=cfg, batches=ctl)
    it = iter(ctl)
    for _ in range(5):
        guard.accumulate(next(it), loss_of(model))
        guard.step()
        opt.zero_grad()
    model.lm_head.weight.grad = torch.zeros_like(model.lm_head.weight)
    a = gg.Action("rollback", 6)
    follow = guard.core.execute(a)
    assert a.params["to_step"] == 4 and a.params["skipped_batches"] == 3
    skip = follow[0]
    assert skip.params["skipped_indices"] == [list(range(20, 24)), list(range(24, 28)), list(range(28, 32))]
    assert skip.params["preceding_indices"][-1] == [16, 17, 18, 19]
    assert next(it).indices == [32, 33, 34, 35]
    guard.close()
    events = [json.loads(x) for x in open(guard.log_path)]
    assert any(e.get("name") == "skip_data" and e["params"]["skipped_indices"] for e in events)


def _ring_with_disk(tmp_path):
    torch.manual_seed(0)
    model = TinyNet()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    return model, opt, SnapshotRing(model, opt, ring_size=3, confirm_steps=1, disk_dir=str(tmp_path / "snaps"))


def test_disk_tier_corrupt_snapshot_falls_back(tmp_path):
    model, opt, ring = _ring_with_disk(tmp_path)
    ring.take(0)
    ring.observe(1, True)
    saved0 = copy.deepcopy(model.state_dict())
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    ring.take(5)
    ring.observe(6, True)
    assert [s.step for s in ring.ring] == [0, 5] and ring.ring[0].state == {}  # no copy kept in memory
    path = ring.disk.path(5)
    data = bytearray(open(path, "rb").read())
    data[len(data) // 2] ^= 0xFF
    open(path, "wb").write(bytes(data))
    restored = ring.restore(ring.best(), restore_schedule=True)
    assert restored.step == 0 and "checksum" in ring.problems[0]
    for k, v in model.state_dict().items():
        assert torch.equal(v, saved0[k])


def test_disk_tier_survives_sigkill_while_writing(tmp_path):
    d = tmp_path / "snaps"
    script = textwrap.dedent(f"""
        import os, signal, torch
        from gradguard.snapshot import DiskSnapshots, _HashingWriter
        disk = DiskSnapshots({str(d)!r})
        disk.write(1, {{"w": torch.arange(10.0)}})
        written = [0]
        orig = _HashingWriter.write
        def dying_write(self, data):
            written[0] += len(data)
            if written[0] > 1_000_000:
                os.kill(os.getpid(), signal.SIGKILL)
            return orig(self, data)
        _HashingWriter.write = dying_write
        disk.write(2, {{"w": torch.zeros(2_000_000)}})
    """)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, timeout=120)
    assert proc.returncode == -signal.SIGKILL
    names = sorted(os.listdir(d))
    assert "snapshot-000000001.pt" in names and any(".tmp-" in n for n in names)
    step, state, problems = DiskSnapshots(str(d)).latest_valid()
    assert step == 1 and torch.equal(state["w"], torch.arange(10.0))


@pytest.mark.slow
def test_corrupted_data_window_recovers_where_clipping_does_not(tmp_path):
    """Real training: 15 batches with garbage labels mid-run. Clipping alone carries the damage;
    the guard skips the first two spikes (on the same weights: bad data or damaged weights), rolls
    back on the third without an LR cut, blames the data once the restored weights spike too (skips
    the window, returns to the weights it left) and ends near the clean run."""
    from gradguard.demo_model import ByteBatches, TinyGPT, evaluate, load_corpus

    data = ByteBatches(load_corpus(300_000), 32)
    ev = data.eval_batches(32, 4)

    def run(mode):
        torch.manual_seed(0)
        g = torch.Generator().manual_seed(0)
        m = TinyGPT(n_layer=2, width=64, seq_len=32)
        opt = torch.optim.AdamW(m.parameters(), lr=3e-3)
        guard = None
        if mode == "guard":
            cfg = gg.GuardConfig.preset("default", output={"dir": str(tmp_path), "console": False},
                                        recovery={"snapshot_interval": 20})
            guard = gg.Guard(m, opt, config=cfg)
        for s in range(1, 301):
            x, y = data.train_batch(32, g)
            if mode != "clean" and 60 <= s < 75:
                y = torch.zeros_like(y)
            loss = m(x, y)
            loss.backward()
            if guard is not None:
                guard.step(loss)
            else:
                torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0)
                opt.step()
            opt.zero_grad()
        return evaluate(m, ev), (guard.close() if guard else None)

    clean, _ = run("clean")
    clipped, _ = run("clip")
    guarded, summary = run("guard")
    assert clipped > 1.06 * clean  # the damage is real
    assert guarded < 1.04 * clean  # and the guard undoes it
    assert summary["actions"]["rollback"] == 1 and summary["actions"]["undo_rollback"] == 1
    assert "lower_lr" not in summary["actions"] and summary["lr_multiplier"] == 1.0
    assert 14 <= summary["skipped"] <= 17


def test_average_gradients_in_buckets_keeps_values_and_missing_gradients():
    """The DDP accumulate path's gradient sync (gradguard.oom.average_gradients), on a collective that
    doubles what it averages (so a bucket that is not copied back shows): buckets split at
    ``bucket_elements`` (in order), every bucket reduced once, a gradient held on no rank stays None and one
    held on some rank only (per the vote) counts zeros here."""
    from gradguard.oom import average_gradients

    class Doubling:
        world_size = 2
        calls = 0

        def mean(self, packed):
            Doubling.calls += 1
            return packed * 2

    ps = [torch.nn.Parameter(torch.randn(n)) for n in (3, 4, 5, 2)]
    grads = [torch.randn(3), torch.randn(4), None, None]
    for p, g in zip(ps, grads):
        p.grad = None if g is None else g.clone()
    average_gradients(Doubling(), ps, [True, True, False, True], bucket_elements=6)
    assert Doubling.calls == 2  # [3] then [4, 2]: a bucket never grows past 6 elements
    assert torch.equal(ps[0].grad, grads[0] * 2) and torch.equal(ps[1].grad, grads[1] * 2)
    assert ps[2].grad is None  # no rank held one
    assert torch.equal(ps[3].grad, torch.zeros(2))  # another rank held one: zeros here


class _OtherRank:
    """A two-process collective as rank 0 sees it: ``mean`` adds what rank 1 packed (its outcome in
    the vote of gradguard.oom.OomRecovery.agree: pieces, failed, skipped, samples; a gradient for
    every parameter)."""

    world_size = 2

    def __init__(self, pieces=0, failed=0, skipped=0, samples=8):
        self.rank1 = [pieces, failed, skipped, samples]

    def mean(self, packed):
        other = torch.zeros_like(packed)
        other[4:8] = torch.tensor(self.rank1, dtype=packed.dtype)
        other[8:] = 1.0
        return (packed + other) / 2


@pytest.mark.parametrize("rank1,expect", [
    ({"pieces": 4}, "shrink"),  # rank 1 needed 4 pieces of its 8 samples: every rank runs 2 from now on
    ({"skipped": 1}, "skip"),  # rank 1's error hit after earlier micro-batches: every rank skips the step
    ({"failed": 1}, "raise"),  # one sample did not fit on rank 1: every rank raises
    ({}, "nothing"),
])
def test_every_rank_vote_gives_rank0_the_same_response_as_rank1(rank1, expect):
    from gradguard.oom import OomRecovery

    recorded, sizes = [], []

    class Core:
        config = gg.GuardConfig()
        step_count = 5

        def record(self, action):
            recorded.append(action)

    p = torch.nn.Parameter(torch.ones(3))
    p.grad = torch.ones(3)
    rule = OomRecovery(Core(), lambda: [p], lambda fits: (sizes.append(fits), (8, fits))[1])
    if expect == "raise":
        with pytest.raises(torch.OutOfMemoryError, match=r"rank\(s\) \[1\] of 2 with a single sample"):
            rule.agree(_OtherRank(**rank1), samples=8, parts=1, failed=False, params=[p])
        assert p.grad is None
        return
    held, skip = rule.agree(_OtherRank(**rank1), samples=8, parts=1, failed=False, params=[p])
    names = [(a.name, a.step, a.params["ranks"], a.params["micro_batch"]) for a in recorded]
    if expect == "shrink":
        assert (held, skip) == ([True], False) and sizes == [2] and names == [("oom_shrink_micro", 6, [1], [8, 2])]
    elif expect == "skip":
        assert skip and p.grad is None and names == [("oom_skip_step", 6, [1], [8, 4])]
    else:
        assert (held, skip) == ([True], False) and not recorded and sizes == [] and p.grad is not None
