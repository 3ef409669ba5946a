"""gradguard.testing injectors on their own: step clock, determinism, clean detach, clear errors."""

import pytest
import torch

import gradguard as gg
from gradguard.testing import INJECTORS, CorruptBatch, GradFault, LRSpike, NaNLoss, OutOfMemory, SnapshotIOFault

from .conftest import TinyNet, make_batch


def _losses(model, n, gen, opt=None):
    out = []
    for _ in range(n):
        loss = model(*make_batch(gen))
        loss.backward()
        if opt is not None:
            opt.step()
            opt.zero_grad()
        out.append(loss.item())
    return out


def test_without_a_guard_training_forwards_are_counted_per_step():
    torch.manual_seed(0)
    model = TinyNet()
    gen = torch.Generator().manual_seed(0)
    with NaNLoss(at_step=3, steps=1).attach(model, forwards_per_step=2) as inj:
        losses = _losses(model, 8, gen)
        model.eval()
        assert torch.isfinite(model(*make_batch(gen)))  # evaluation forwards are neither counted nor hit
    nan_at = [i for i, v in enumerate(losses) if v != v]
    assert nan_at == [4, 5] and inj.fired == [3]  # step 3 = forwards 5 and 6
    assert all(v == v for v in _losses(model.train(), 3, gen))  # detached: no hook left


def test_grad_fault_hits_only_the_named_layer_and_is_deterministic():
    torch.manual_seed(0)
    model = TinyNet()
    gen = torch.Generator().manual_seed(0)
    with GradFault("blocks.1", at_step=1, kind="huge", factor=1e3).attach(model):
        model(*make_batch(gen)).backward()
    hit = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    model(*make_batch(torch.Generator().manual_seed(0))).backward()
    for n, p in model.named_parameters():
        factor = 1e3 if n.startswith("blocks.1.") else 1.0
        torch.testing.assert_close(hit[n], p.grad * factor)
    with pytest.raises(ValueError, match=r"GradFault.layer='block.9': no trainable parameter.*Fix: use a module path"):
        GradFault("block.9", at_step=1).attach(model)
    with pytest.raises(ValueError, match=r"GradFault.kind='zero': unknown"):
        GradFault("blocks.0", at_step=1, kind="zero")


def test_corrupt_batch_is_seeded_and_oom_raises_above_a_batch_size():
    torch.manual_seed(0)
    model = TinyNet()
    seen = []
    model.embed.register_forward_pre_hook(lambda m, a: seen.append(a[0].clone()))  # what the model got
    gen_batch = make_batch(torch.Generator().manual_seed(0))
    for _ in range(2):
        with CorruptBatch(at_step=1, seed=7).attach(model):
            model(*gen_batch)
    assert torch.equal(seen[0], seen[1]) and not torch.equal(seen[0], gen_batch[0])
    with OutOfMemory(at_step=1, above_batch=4).attach(model) as oom:
        with pytest.raises(torch.OutOfMemoryError, match="injected by gradguard.testing"):
            model(*make_batch(torch.Generator().manual_seed(0), bs=8))
        model(*make_batch(torch.Generator().manual_seed(0), bs=4))  # small enough
    assert oom.raised == 1


def test_lr_spike_restores_the_users_lr_on_detach_and_bad_arguments_are_named():
    model = TinyNet()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    spike = LRSpike(factor=10, at_step=1, steps=None).attach(model, opt)
    _losses(model, 2, torch.Generator().manual_seed(0), opt)
    assert opt.param_groups[0]["lr"] == pytest.approx(1.0)
    spike.detach()
    assert opt.param_groups[0]["lr"] == 0.1
    with pytest.raises(ValueError, match=r"NaNLoss.at_step=0: must be an int >= 1.*Fix"):
        NaNLoss(at_step=0)
    with pytest.raises(ValueError, match=r"LRSpike.attach: optimizer=None"):
        LRSpike(at_step=1).attach(model)
    with pytest.raises(ValueError, match=r"SnapshotIOFault\(target='snapshots'\).attach: guard=None"):
        SnapshotIOFault(at_step=1).attach(model)
    from gradguard.testing import SinkFault

    with pytest.raises(ValueError, match=r"SinkFault.attach: guard=None"):
        SinkFault(at_step=1).attach(model)
    assert set(INJECTORS) == {"nan_loss", "grad_fault", "lr_spike", "corrupt_batch", "out_of_memory",
                              "overflow_streak", "io_fault", "sink_fault"}


def test_io_fault_makes_real_writes_fail_and_is_lifted_after_its_window(tmp_path):
    torch.manual_seed(0)
    model = TinyNet()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sink = gg.MemorySink()
    cfg = gg.GuardConfig.preset("default", output={"dir": str(tmp_path / "out"), "console": False},
                                recovery={"snapshot_interval": 1, "confirm_steps": 1,
                                          "disk_dir": str(tmp_path / "snaps")})
    guard = gg.Guard(model, opt, config=cfg, sinks=[sink])
    gen = torch.Generator().manual_seed(0)
    with SnapshotIOFault(at_step=3, steps=2).attach(model, guard=guard), pytest.warns(RuntimeWarning):
        for _ in range(6):
            loss = model(*make_batch(gen))
            loss.backward()
            guard.step(loss)
            opt.zero_grad()
    errors = [e for e in sink.events if e["type"] == "snapshot_io_error"]
    assert errors and errors[0]["step"] == 3 and "injected" in errors[0]["error"]
    assert guard.core.snapshots.disk_writable is False  # degraded for the rest of the run, by design
    guard.close()
