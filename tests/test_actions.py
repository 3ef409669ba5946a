"""Each action on a real optimizer and scheduler."""

import copy

import pytest
import torch

import gradguard as gg

from .conftest import TinyNet, make_batch

SCHEDULERS = {
    "LambdaLR": lambda o: torch.optim.lr_scheduler.LambdaLR(o, lambda s: min(1.0, (s + 1) / 10) * 0.99 ** s),
    "CosineAnnealingLR": lambda o: torch.optim.lr_scheduler.CosineAnnealingLR(o, T_max=100),
    "OneCycleLR": lambda o: torch.optim.lr_scheduler.OneCycleLR(o, max_lr=0.01, total_steps=200),
    "CyclicLR": lambda o: torch.optim.lr_scheduler.CyclicLR(o, 1e-4, 1e-2, step_size_up=7),
    "SequentialLR": lambda o: torch.optim.lr_scheduler.SequentialLR(
        o, [torch.optim.lr_scheduler.LinearLR(o, 0.1, 1.0, 10), torch.optim.lr_scheduler.ExponentialLR(o, 0.98)],
        milestones=[10]),
    "ChainedScheduler": lambda o: torch.optim.lr_scheduler.ChainedScheduler(
        [torch.optim.lr_scheduler.ConstantLR(o, 0.5, total_iters=20), torch.optim.lr_scheduler.ExponentialLR(o, 0.99)]),
    "ReduceLROnPlateau": lambda o: torch.optim.lr_scheduler.ReduceLROnPlateau(o, factor=0.5, patience=3),
}


def _opt(model):
    return torch.optim.AdamW([{"params": model.embed.parameters()},
                              {"params": [p for n, p in model.named_parameters() if not n.startswith("embed")],
                               "lr": 2e-3}], lr=1e-3)


@pytest.mark.parametrize("name", list(SCHEDULERS))
def test_lr_multiplier_holds_for_100_steps(name, quiet_cfg):
    torch.manual_seed(0)
    ref_model, model = TinyNet(), TinyNet()
    model.load_state_dict(ref_model.state_dict())
    ref_opt, opt = _opt(ref_model), _opt(model)
    ref_sched, sched = SCHEDULERS[name](ref_opt), SCHEDULERS[name](opt)
    guard = gg.Guard(model, opt, scheduler=sched, config=quiet_cfg(clip={"mode": "off"}))
    guard.core.lr.global_mult = guard.core.lr.global_ceiling = 0.25  # no recovery above it
    seen = []
    opt.register_step_pre_hook(lambda o, a, k: seen.append([g["lr"] for g in o.param_groups]))
    gen = torch.Generator().manual_seed(1)
    plateau = isinstance(sched, torch.optim.lr_scheduler.ReduceLROnPlateau)
    for i in range(100):
        x, y = make_batch(gen)
        for m, _o in ((ref_model, ref_opt), (model, opt)):
            m(x, y).backward()
        expected = [g["lr"] * 0.25 for g in ref_opt.param_groups]
        ref_opt.step()
        ref_opt.zero_grad()
        guard.step(1.0)
        opt.zero_grad()
        if plateau:  # the caller steps ReduceLROnPlateau with its metric
            metric = 1.0 if i < 50 else 2.0
            ref_sched.step(metric)
            sched.step(metric)
        else:
            ref_sched.step()
        assert seen[-1] == pytest.approx(expected), f"step {i}"
        assert [g["lr"] for g in opt.param_groups] == pytest.approx([g["lr"] for g in ref_opt.param_groups])
    assert guard.state_dict()["lr"]["global_mult"] == 0.25


def test_layer_multiplier_scales_only_that_layers_update(quiet_cfg):
    torch.manual_seed(0)
    ref, model = TinyNet(), TinyNet()
    model.load_state_dict(ref.state_dict())
    ref_opt = torch.optim.AdamW([{"params": [p for n, p in ref.named_parameters() if not n.startswith("lm_head")]},
                                 {"params": ref.lm_head.parameters(), "lr": 1e-4}], lr=1e-3)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    guard = gg.Guard(model, opt, config=quiet_cfg(clip={"mode": "off"}))
    guard.core.lr.layer_mult["lm_head"] = 0.1
    gen = torch.Generator().manual_seed(0)
    for _ in range(5):
        x, y = make_batch(gen)
        ref(x, y).backward()
        ref_opt.step()
        ref_opt.zero_grad()
        model(x, y).backward()
        guard.step(1.0)
        opt.zero_grad()
    for (n, p), q in zip(model.named_parameters(), ref.parameters()):
        assert torch.allclose(p, q, atol=1e-6, rtol=1e-5), n


def _state_equal(a, b):
    assert a.keys() == b.keys()
    for k in a:
        for kk, v in a[k].items():
            assert torch.equal(v, b[k][kk]), (k, kk)


@pytest.mark.parametrize("with_scaler", [False, True])
def test_skipped_step_is_bit_identical(with_scaler, quiet_cfg):
    torch.manual_seed(0)
    model = TinyNet()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 8) if with_scaler else None
    guard = gg.Guard(model, opt, scaler=scaler, config=quiet_cfg())
    gen = torch.Generator().manual_seed(0)

    def backward(poison=False):
        x, y = make_batch(gen)
        with torch.autocast("cpu", dtype=torch.float16, enabled=with_scaler):
            loss = model(x, y)
        if poison:
            loss = loss * float("nan")
        (scaler.scale(loss) if scaler else loss).backward()
        return loss

    for _ in range(3):
        guard.step(backward())
        opt.zero_grad()
    params = copy.deepcopy(model.state_dict())
    state = copy.deepcopy(opt.state_dict()["state"])
    report = guard.step(backward(poison=True))
    opt.zero_grad()
    assert report.skipped and "non-finite" in report.skip_reason or "overflow" in report.skip_reason
    for k, v in model.state_dict().items():
        assert torch.equal(v, params[k]), k
    _state_equal(opt.state_dict()["state"], state)
    assert all(torch.isfinite(v).all() for v in model.state_dict().values())
    report = guard.step(backward())  # training continues normally afterwards
    assert report.applied
    assert opt.state_dict()["state"][0]["step"].item() == state[0]["step"].item() + 1


def test_adam_beta2_eps_change_keeps_state(quiet_cfg):
    torch.manual_seed(0)
    model = TinyNet()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.999), eps=1e-8)
    guard = gg.Guard(model, opt, config=quiet_cfg(clip={"mode": "off"}))
    gen = torch.Generator().manual_seed(0)
    for _ in range(3):
        model(*make_batch(gen)).backward()
        guard.step(1.0)
        opt.zero_grad()
    before = copy.deepcopy(opt.state_dict()["state"])
    changes = guard.core.adam.apply()
    assert changes["group0"] == {"beta2": [0.999, 0.95], "eps": [1e-8, 1e-6]}
    assert opt.param_groups[0]["betas"] == (0.9, 0.95) and opt.param_groups[0]["eps"] == 1e-6
    _state_equal(opt.state_dict()["state"], before)
    # the new beta2 is what the next step uses: compare with a reference optimizer at beta2 0.95
    ref = copy.deepcopy(model)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-3, betas=(0.9, 0.95), eps=1e-6)
    ref_opt.load_state_dict(copy.deepcopy(opt.state_dict()))
    x, y = make_batch(gen)
    model(x, y).backward()
    ref(x, y).backward()
    guard.step(1.0)
    ref_opt.step()
    for p, q in zip(model.parameters(), ref.parameters()):
        assert torch.equal(p, q)


def test_clip_tighten_relax_and_adaptive(quiet_cfg):
    from gradguard.act import ClipController
    from gradguard.config import ClipConfig

    c = ClipController(ClipConfig(max_norm=0.5, floor=0.1, relax_after=3))
    assert c.tighten() == (0.5, 0.25) and c.tighten() == (0.25, 0.125) and c.tighten() == (0.125, 0.1)
    moves = [c.tick_healthy() for _ in range(9)]
    assert moves[2] == (0.1, 0.2) and moves[5] == (0.2, 0.4) and moves[8] == (0.4, 0.5)
    a = ClipController(ClipConfig(mode="adaptive", max_norm=100.0, adaptive_warmup=10))
    for i in range(50):
        thr = a.threshold(1.0 + 0.01 * (i % 5))
        a.observe(1.0 + 0.01 * (i % 5), thr)
    thr = a.threshold(10.0)
    assert 1.0 < thr < 1.2  # z-score clipping, far below the fixed ceiling
    g = [torch.full((4,), 5.0)]
    assert a.apply(g, 10.0, thr)
    # the gradient (norm 10) is scaled to the threshold
    assert torch.linalg.vector_norm(g[0]).item() == pytest.approx(thr, rel=1e-4)


def test_clipping_reuses_measured_norm(quiet_cfg):
    torch.manual_seed(0)
    model, ref = TinyNet(), TinyNet()
    ref.load_state_dict(model.state_dict())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    guard = gg.Guard(model, opt, config=quiet_cfg(clip={"max_norm": 0.05, "floor": 0.01}))
    gen = torch.Generator().manual_seed(0)
    x, y = make_batch(gen)
    model(x, y).backward()
    ref(x, y).backward()
    rep = guard.step(1.0)
    torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.05)
    ref_opt.step()
    assert rep.clipped and rep.clip_to == 0.05
    for p, q in zip(model.parameters(), ref.parameters()):
        assert torch.allclose(p, q, atol=1e-7)
