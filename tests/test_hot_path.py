"""The hot path: one fused pass over the gradients per step for any float dtype, the engine's own norm
pass taken over (HF Trainer, Lightning) and the user's clip replayed bit for bit in monitor mode."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import gradguard as gg
from gradguard.guard import GuardCore
from gradguard.measure import EngineClip, GradMeasurer, LayerMap, default_layer_name

from .conftest import TinyNet, make_batch

pytestmark = pytest.mark.usefixtures("one_thread")

_BITS = {torch.float16: torch.int16, torch.bfloat16: torch.int16, torch.float32: torch.int32,
         torch.float64: torch.int64}


def bits(t: torch.Tensor) -> torch.Tensor:
    """The raw bits (nan == nan, -0.0 != 0.0): bitwise comparison."""
    return t.detach().contiguous().view(_BITS[t.dtype])


def same_bits(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(x.dtype == y.dtype and torch.equal(bits(x), bits(y)) for x, y in zip(a, b))


class CountNorms:
    """Counts calls of the fused norm kernel (``torch._foreach_norm``): one per pass over the gradients
    of one (device, dtype) group."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.calls = 0
        orig = torch._foreach_norm

        def counted(*a, **k):
            self.calls += 1
            return orig(*a, **k)

        monkeypatch.setattr(torch, "_foreach_norm", counted)


def _stack(dtypes: list[torch.dtype]) -> nn.Module:
    torch.manual_seed(0)
    m = nn.Sequential(*[nn.Linear(12, 12) for _ in dtypes])
    for layer, dt in zip(m, dtypes):
        layer.to(dt)
    return m


# -- the measurement ---------------------------------------------------------------------------------
@pytest.mark.parametrize("dtypes", [
    [torch.float32] * 3, [torch.bfloat16] * 3, [torch.float16] * 3, [torch.float64] * 3,
    [torch.float32, torch.bfloat16, torch.float64, torch.float16],
], ids=["fp32", "bf16", "fp16", "fp64", "mixed"])
@pytest.mark.parametrize("max_norm", [1e-3, 0.5, 1e9])
@pytest.mark.parametrize("order", ["reversed", "same"])
def test_engine_clip_replay_is_bitwise_clip_grad_norm(dtypes, max_norm, order):
    """The per-layer pass also gives clip_grad_norm_'s total and scales exactly as it would: any float
    dtype, dtypes mixed in one model, the engine's parameter order different from the model's or the
    same (then the pass's own stack of norms is reused), gradients spanning 6 orders of magnitude
    (fp16 norms overflowing to inf included)."""
    for seed in range(12):
        m = _stack(dtypes)
        gen = torch.Generator().manual_seed(seed)
        for p in m.parameters():
            scale = 10.0 ** int(torch.randint(-3, 4, (1,), generator=gen))
            p.grad = (torch.randn(p.shape, generator=gen) * scale).to(p.dtype)
        engine_order = list(m.parameters())[::-1] if order == "reversed" else list(m.parameters())
        twins = []
        for p in engine_order:
            q = torch.zeros_like(p)
            q.grad = p.grad.clone()
            twins.append(q)
        want = torch.nn.utils.clip_grad_norm_(twins, max_norm)
        meas = GradMeasurer(LayerMap(m))
        got = meas.measure([2.5], engine=EngineClip(engine_order, max_norm))
        total = meas.replay_clip(got.engine_coef)
        assert total is not None and same_bits([total], [want])
        assert same_bits([p.grad for p in engine_order], [q.grad for q in twins]), seed
        assert same_bits([torch.tensor(got.engine_norm, dtype=torch.float64)],
                         [want.detach().double()])
        assert got.extras == [2.5]


def test_engine_total_reuses_the_pass_stack_when_the_engine_clips_the_same_parameters(monkeypatch):
    """The engine clipping the layer map's parameters in its order (Lightning, HF): its total comes
    from the pass's own stack of norms (one torch.stack per step, not two)."""
    m = _stack([torch.float32] * 3)
    for p in m.parameters():
        p.grad = torch.randn_like(p)
    meas = GradMeasurer(LayerMap(m))
    calls = []
    orig = torch.stack
    monkeypatch.setattr(torch, "stack", lambda *a, **k: calls.append(1) or orig(*a, **k))
    meas.measure([1.0], engine=EngineClip(list(m.parameters()), 0.5))
    assert len(calls) == 1
    meas.measure([1.0], engine=EngineClip(list(m.parameters())[::-1], 0.5))
    assert len(calls) == 3  # another order: clip_grad_norm_'s own stack is made


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16, torch.float16])
def test_layer_norms_of_any_dtype_match_a_float64_reference(dtype):
    m = _stack([dtype, torch.float32, dtype])
    gen = torch.Generator().manual_seed(0)
    for p in m.parameters():
        p.grad = torch.randn(p.shape, generator=gen).to(dtype=p.dtype)
    layers = LayerMap(m)
    got = GradMeasurer(layers).measure()
    for name, v in zip(layers.layer_names, got.layer_norms):
        grads = [p.grad for n, p in m.named_parameters() if default_layer_name(n) == name]
        ref = torch.cat([g.double().flatten() for g in grads]).norm().item()
        # float64 gradients are summed in float64; 16-bit ones are normed in float32 (not in 16 bits)
        assert v == pytest.approx(ref, rel=1e-12 if grads[0].dtype == torch.float64 else 1e-6)


def test_one_fused_pass_per_step_and_no_host_buffer_churn(monkeypatch):
    m = _stack([torch.float32] * 3)
    meas = GradMeasurer(LayerMap(m))
    counter = CountNorms(monkeypatch)
    for step in range(5):
        for p in m.parameters():
            p.grad = torch.full_like(p, float(step + 1))
        meas.measure([1.0, None, torch.tensor(3.0)])
    assert counter.calls == 5 and meas.transfers == 5
    buf = meas._buf
    meas.measure([1.0, None, torch.tensor(3.0)])
    assert meas._buf is buf  # the packed buffer is kept between steps


# -- float64 and 16-bit training in the plain loop ---------------------------------------------------
def test_float64_model_trains_guarded_in_the_plain_loop(quiet_cfg, monkeypatch):
    torch.manual_seed(0)
    model = TinyNet().double()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    guard = gg.Guard(model, opt, config=quiet_cfg(clip={"max_norm": 0.05, "floor": 0.01}, measure={"log_interval": 3},
                                                 output={"metrics_interval": 3}))
    seen = []
    guard.core.sinks.append(type("S", (gg.sinks.Sink,), {"log_metrics": lambda self, step, m: seen.append(m)})())
    counter = CountNorms(monkeypatch)
    gen = torch.Generator().manual_seed(0)
    for _ in range(6):
        loss = model(*make_batch(gen))
        loss.backward()
        ref = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in model.parameters()])).item()
        calls = counter.calls
        report = guard.step(loss)
        # one pass per step; parameter and update norms (two more) on log steps only
        assert counter.calls - calls == (3 if report.step % 3 == 0 else 1)
        opt.zero_grad()
        assert report.applied and report.clipped
        assert report.total_norm == pytest.approx(ref, rel=1e-12)
        assert isinstance(report.loss, float)
    assert all(p.dtype == torch.float64 and torch.isfinite(p).all() for p in model.parameters())
    assert len(seen) == 2 and 0 < seen[-1]["gradguard/update_ratio/lm_head"] < 1
    guard.close()


def _amp_run(mode: str, guarded: bool, steps: int = 6, clip: float = 0.05) -> list[torch.Tensor]:
    """A plain fp16 (GradScaler) / bf16-autocast / bf16 model loop clipping with clip_grad_norm_, or a
    monitor guard replaying that clip from its own pass."""
    torch.manual_seed(0)
    model = TinyNet()
    if mode == "bf16-model":
        model = model.to(torch.bfloat16)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10) if mode == "fp16-scaler" else None
    core = None
    if guarded:
        cfg = gg.GuardConfig.preset("monitor", output={"jsonl": False, "console": False})
        core = GuardCore(model, opt, config=cfg, scaler=scaler)
    gen = torch.Generator().manual_seed(1)
    params = list(model.parameters())
    for _ in range(steps):
        x, y = make_batch(gen)
        dtype = torch.float16 if mode == "fp16-scaler" else torch.bfloat16
        with torch.autocast("cpu", dtype=dtype, enabled=mode != "bf16-model"):
            loss = model(x, y)
        (scaler.scale(loss) if scaler is not None else loss).backward()
        if scaler is not None:
            scaler.unscale_(opt)
        if core is None:
            torch.nn.utils.clip_grad_norm_(params, clip)
        else:
            report = core.before_step(loss, scaler=scaler, engine_clip=EngineClip(params, clip))
            assert core.replay_engine_clip(report) is not None
        if scaler is not None:
            scaler.step(opt)
            scaler.update()
        else:
            opt.step()
        if core is not None:
            core.after_step(report)
        opt.zero_grad()
    if core is not None:
        assert core.measurer.transfers == steps
        core.close()
    return [p.detach().clone() for p in params]


@pytest.mark.parametrize("mode", ["fp16-scaler", "bf16-autocast", "bf16-model"])
def test_monitor_clip_replay_is_bit_identical_under_amp(mode):
    assert same_bits(_amp_run(mode, guarded=True), _amp_run(mode, guarded=False))


def _plain_guard_run(mode: str, guarded: bool, counter: CountNorms, steps: int = 6,
                     clip: float = 0.05) -> tuple[list[torch.Tensor], list[int]]:
    """The plain ``Guard``: a monitor guard given ``clip.mode='fixed'`` in place of the user's own
    ``clip_grad_norm_``; returns the weights and the fused norm calls of every step."""
    torch.manual_seed(0)
    model = TinyNet()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10) if mode == "fp16-scaler" else None
    cfg = gg.GuardConfig.preset("monitor", clip={"mode": "fixed", "max_norm": clip, "floor": clip},
                                output={"jsonl": False, "console": False})
    guard = gg.Guard(model, opt, config=cfg, scaler=scaler) if guarded else None
    gen = torch.Generator().manual_seed(1)
    calls = []
    for _ in range(steps):
        x, y = make_batch(gen)
        with torch.autocast("cpu", dtype=torch.float16, enabled=scaler is not None):
            loss = model(x, y)
        (scaler.scale(loss) if scaler is not None else loss).backward()
        before = counter.calls
        if guard is None:
            if scaler is not None:
                scaler.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
            if scaler is not None:
                scaler.step(opt)
                scaler.update()
            else:
                opt.step()
        else:
            report = guard.step(loss)
            assert report.applied and report.engine_norm is not None and report.engine_coef < 1
        calls.append(counter.calls - before)
        opt.zero_grad()
    if guard is not None:
        guard.close()
    return [p.detach().clone() for p in model.parameters()], calls


@pytest.mark.parametrize("mode", ["fp32", "fp16-scaler"])
def test_plain_monitor_with_a_fixed_clip_applies_it_bit_identically_in_one_pass(monkeypatch, mode):
    counter = CountNorms(monkeypatch)
    ref, ref_calls = _plain_guard_run(mode, guarded=False, counter=counter)
    got, calls = _plain_guard_run(mode, guarded=True, counter=counter)
    assert same_bits(got, ref)
    # the user's loop makes one norm pass per step; the guard makes one too (its per-layer pass also
    # yields clip_grad_norm_'s total), plus the parameter / update norms on its log steps only
    assert ref_calls == [1] * 6
    assert [c for i, c in enumerate(calls, 1) if i % gg.GuardConfig().measure.log_interval] == [1] * len(
        [i for i in range(1, 7) if i % gg.GuardConfig().measure.log_interval])


# -- Lightning ---------------------------------------------------------------------------------------
L = pytest.importorskip("lightning.pytorch")


class _Lit(L.LightningModule):
    """No hook overrides: Lightning's own clip runs where the guard can take it over."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = TinyNet()

    def training_step(self, batch, batch_idx):
        return self.net(*batch)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


def _lit_loader():
    x, y = make_batch(torch.Generator().manual_seed(0), bs=96)
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=8)


def _lit_fit(tmp_path, callbacks, precision, clip=0.05, steps=6):
    if precision == "16-mixed":  # fp16 AMP with a real GradScaler on CPU (Lightning's own plugin)
        from lightning.pytorch.plugins import MixedPrecision

        kw = {"plugins": [MixedPrecision("16-mixed", "cpu")]}
    else:
        kw = {"precision": precision}
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=steps, callbacks=callbacks, logger=False,
                        enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
                        default_root_dir=str(tmp_path), gradient_clip_val=clip, **kw)
    module = _Lit()
    trainer.fit(module, _lit_loader())
    return trainer, module


@pytest.mark.parametrize("precision", ["16-mixed", "bf16-mixed", "bf16-true", "64-true"])
def test_lightning_monitor_takes_the_clip_over_bit_identically(tmp_path, monkeypatch, precision):
    from gradguard.lightning import GradGuardCallback

    _, plain = _lit_fit(tmp_path / "a", [], precision)
    counter = CountNorms(monkeypatch)
    calls = []
    orig_clip = torch.nn.utils.clip_grad_norm_
    monkeypatch.setattr(torch.nn.utils, "clip_grad_norm_", lambda *a, **k: calls.append(1) or orig_clip(*a, **k))
    cb = GradGuardCallback(gg.GuardConfig.preset("monitor", output={"console": False}))
    trainer, guarded = _lit_fit(tmp_path / "b", [cb], precision)
    assert same_bits(list(guarded.parameters()), list(plain.parameters()))
    assert cb.core.step_count == 6 and calls == []  # Lightning's clip_grad_norm_ was replaced ...
    assert counter.calls == 6  # ... by the guard's one pass per step
    assert trainer.gradient_clip_val == 0.05
    if precision == "16-mixed":
        assert isinstance(trainer.precision_plugin.scaler, torch.amp.GradScaler)
    assert vars(trainer.precision_plugin).get("clip_grad_by_norm") is None  # taken off after fit


def test_lightning_float64_default_preset_runs(tmp_path):
    from gradguard.lightning import GradGuardCallback

    cb = GradGuardCallback(gg.GuardConfig.preset("default", output={"console": False}))
    trainer, module = _lit_fit(tmp_path, [cb], "64-true", clip=None)
    assert cb.core.step_count == 6 and cb.core.skipped_steps == 0
    assert all(p.dtype == torch.float64 and torch.isfinite(p).all() for p in module.parameters())


# -- HF Trainer --------------------------------------------------------------------------------------
transformers = pytest.importorskip("transformers")


def _hf_run(tmp_path, callbacks, steps=5, model_dtype=None, **kw):
    from .test_hf import make_trainer, tiny_gpt2

    model = tiny_gpt2()
    if model_dtype is not None:
        model = model.to(model_dtype)
    tr = make_trainer(tmp_path, callbacks, steps=steps, model=model, **kw)
    tr.train()
    return tr


@pytest.mark.parametrize("preset", ["monitor", "default"])
def test_hf_trainer_norm_pass_is_taken_over(tmp_path, monkeypatch, preset):
    from gradguard.hf import GradGuardCallback

    plain = _hf_run(tmp_path / "a", [])
    counter = CountNorms(monkeypatch)
    # layer_metrics=False: no per-layer update ratios, whose parameter norms (logging steps only;
    # logging_steps=1 here) would add passes over the weights, not over the gradients
    cb = GradGuardCallback(gg.GuardConfig.preset(preset, output={"console": False}), layer_metrics=False)
    guarded = _hf_run(tmp_path / "b", [cb])
    assert counter.calls == 5  # one gradient pass per step: the Trainer's own norm pass does not run
    la = [h for h in plain.state.log_history if "loss" in h]
    lb = [h for h in guarded.state.log_history if "loss" in h]
    assert len(lb) == 5 and all("grad_norm" in h for h in lb)
    if preset == "monitor":  # the Trainer's clip (max_grad_norm=1.0), replayed: same weights, same log
        for p, q in zip(plain.model.parameters(), guarded.model.parameters()):
            assert torch.equal(p, q)
        assert [h["grad_norm"] for h in la] == [h["grad_norm"] for h in lb]
    for h in lb:
        assert h["grad_norm"] == pytest.approx(h["gradguard/grad_norm/total"], rel=1e-5)
    assert "_clip_grad_norm" not in vars(guarded)  # the Trainer's method is back after training


def test_hf_float64_model_trains_guarded(tmp_path):
    from gradguard.hf import GradGuardCallback

    cb = GradGuardCallback(gg.GuardConfig.preset("default", output={"console": False}))
    tr = _hf_run(tmp_path, [cb], steps=3, model_dtype=torch.float64)
    assert cb.core.step_count == 3 and cb.core.skipped_steps == 0
    assert all(p.dtype == torch.float64 and torch.isfinite(p).all() for p in tr.model.parameters())
