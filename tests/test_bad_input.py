"""Table-driven bad input (issue 12): every class of mistake gives one clear error (or, for
misuse that training survives, one warning) naming the field or object, the value and the fix;
nothing is half-applied."""

import copy
import json

import pytest
import torch

import gradguard as gg
from gradguard.act import AttachError
from gradguard.state import StateError

from .conftest import TinyNet, make_batch


def _guard(tmp_path, model=None, opt=None, preset="default", **over):
    torch.manual_seed(0)
    model = model or TinyNet()
    opt = opt or torch.optim.AdamW(model.parameters(), lr=1e-2)
    cfg = gg.GuardConfig.preset(preset, output={"dir": str(tmp_path), "console": False}, **over)
    return gg.Guard(model, opt, config=cfg), model, opt


def _trained_state(tmp_path, steps=6, width=16):
    torch.manual_seed(0)
    model = TinyNet(width=width)
    guard, model, opt = _guard(tmp_path / f"src{width}", model=model)
    gen = torch.Generator().manual_seed(0)
    for _ in range(steps):
        loss = model(*make_batch(gen))
        loss.backward()
        guard.step(loss)
        opt.zero_grad()
    guard.core.lr.lower()
    state = json.loads(json.dumps(guard.state_dict()))
    guard.close()
    return state


def _garble(path, value):
    def f(state):
        state = copy.deepcopy(state)
        *parents, last = path
        d = state
        for p in parents:
            d = d[p]
        if value is KeyError:
            del d[last]
        else:
            d[last] = value
        return state
    return f


# (id, how the state is broken, the entry the message names, the value it quotes)
BAD_STATES = [
    ("not-a-dict", lambda s: [s], "state=[", "list"),
    ("version", _garble(["version"], 99), "version=99", "99"),
    ("missing-entry", _garble(["detectors"], KeyError), "entry 'detectors' is missing", "detectors"),
    ("counter-type", _garble(["step_count"], "ten"), "step_count='ten'", "'ten'"),
    ("negative-counter", _garble(["skipped_steps"], -3), "skipped_steps=-3", "-3"),
    ("bool-type", _garble(["verified"], "no"), "verified='no'", "'no'"),
    ("counts", _garble(["action_counts", "lower_lr"], "x"), "action_counts['lower_lr']='x'", "'x'"),
    ("lr-missing", _garble(["lr", "global_mult"], KeyError), "lr: entry 'global_mult' is missing", "global_mult"),
    ("lr-value", _garble(["lr", "global_mult"], float("nan")), "lr.global_mult=nan", "nan"),
    ("lr-layer", _garble(["lr", "layer_mult"], {"lm_head": -1.0}), "lr.layer_mult['lm_head']=-1.0", "-1.0"),
    ("clip-type", _garble(["clip", "max_norm"], "big"), "clip.max_norm='big'", "'big'"),
    ("adam", _garble(["adam", "applied"], 1), "adam.applied=1", "1"),
    ("detector-type", _garble(["detectors", "loss", "healthy"], "many"), "detectors.loss.healthy='many'", "'many'"),
    ("policy-type", _garble(["policy"], "x"), "policy='x'", "'x'"),
    ("config-type", _garble(["config"], "x"), "config='x'", "'x'"),
    ("no-model-signature", _garble(["model_signature"], KeyError), "entry 'model_signature' is missing", "no value"),
    ("model-signature-type", _garble(["model_signature"], None), "model_signature=None", "must be str"),
    # round three (issue 28): values checked for range, not only type
    ("lr-out-of-range", _garble(["lr", "global_mult"], 1e6), "lr.global_mult=1000000.0", "must be in (0, 1]"),
    ("step-count-out-of-range", _garble(["step_count"], 10 ** 30), "step_count=" + str(10 ** 30), "must be an int"),
    # passes the type checks but cannot be applied: rolled back as a whole
    ("detector-garbled", _garble(["detectors"], {"loss": {}}), "could not be applied", "KeyError"),
]


@pytest.mark.parametrize("name,breaker,names,value", BAD_STATES, ids=[b[0] for b in BAD_STATES])
def test_bad_guard_state_is_one_clear_error_and_changes_nothing(tmp_path, name, breaker, names, value):
    state = _trained_state(tmp_path)
    guard, _, _ = _guard(tmp_path / "dst")
    before = guard.state_dict()
    with pytest.raises(StateError) as info:
        guard.load_state_dict(breaker(state))
    msg = str(info.value)
    assert names in msg and value in msg and "Fix:" in msg, msg
    assert guard.state_dict() == before  # all or nothing
    guard.load_state_dict(state)  # the intact state still loads
    assert guard.core.step_count == 6 and guard.core.lr.global_mult < 1
    guard.close()


def test_state_from_another_model_is_refused(tmp_path):
    state = _trained_state(tmp_path, width=8)
    guard, _, _ = _guard(tmp_path / "dst")
    before = guard.state_dict()
    with pytest.raises(StateError, match=r"model_signature='[0-9a-f]+': saved from another model.*Fix:"):
        guard.load_state_dict(state)
    assert guard.state_dict() == before
    unsigned = {k: v for k, v in _trained_state(tmp_path / "unsigned").items() if k != "model_signature"}
    with pytest.raises(StateError, match=r"entry 'model_signature' is missing.*Fix:"):
        guard.load_state_dict(unsigned)  # a state that names no model is refused, not applied unchecked
    assert guard.state_dict() == before
    guard.close()


def test_restore_guard_state_applies_a_good_state_and_refuses_or_sets_aside_a_bad_one(tmp_path):
    from gradguard.adapter import restore_guard_state

    state = _trained_state(tmp_path)
    for preset in ("default", "monitor"):
        guard, _, _ = _guard(tmp_path / preset, preset=preset)
        before = guard.state_dict()
        bad = _garble(["step_count"], -3)(state)
        if preset == "default":
            with pytest.raises(StateError, match=r"step_count=-3.*Fix"):
                restore_guard_state(guard.core, guard.config, bad)
        else:
            with pytest.warns(gg.GradGuardWarning, match=r"step_count=-3.*fresh guard state"):
                assert restore_guard_state(guard.core, guard.config, bad) is False
        assert guard.state_dict() == before and guard.core.checkpoint_tier.entries == []  # nothing changed
        assert restore_guard_state(guard.core, guard.config, None) is True
        assert guard.core.checkpoint_tier.entries == []  # nothing saved: nothing restored
        assert restore_guard_state(guard.core, guard.config, state) is True
        assert guard.core.step_count == 6 and guard.core.checkpoint_tier.entries == state["checkpoints"]  # the state's own tier
        guard.close()


def test_second_acting_guard_and_closure_optimizer_are_refused_at_attach(tmp_path):
    guard, model, opt = _guard(tmp_path)
    with pytest.raises(AttachError) as info:
        gg.Guard(model, opt, config=guard.config)
    assert "optimizer=AdamW" in str(info.value) and "Fix:" in str(info.value)
    guard.close()
    lbfgs = torch.optim.LBFGS(model.parameters())
    with pytest.raises(AttachError, match=r"optimizer=LBFGS needs a closure.*Fix: use a first-order optimizer"):
        gg.Guard(model, lbfgs, config=guard.config)


def test_step_without_loss_and_forgotten_backward_are_explained_once(tmp_path):
    sink = gg.MemorySink()
    torch.manual_seed(0)
    model = TinyNet()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    guard = gg.Guard(model, opt, config=gg.GuardConfig.preset("default", output={"console": False, "jsonl": False}),
                     sinks=[sink])
    gen = torch.Generator().manual_seed(0)
    with pytest.warns(UserWarning, match=r"without a loss.*Fix: pass the step's loss") as rec:
        for _ in range(3):
            model(*make_batch(gen)).backward()
            guard.step()
            opt.zero_grad()
    assert sum("without a loss" in str(w.message) for w in rec) == 1  # once
    with pytest.warns(UserWarning, match=r"all zero or absent for 3 steps.*Fix: call loss.backward\(\)"):
        for _ in range(5):
            guard.step(model(*make_batch(gen)))  # backward forgotten
    kinds = [e["kind"] for e in sink.events if e["type"] == "misuse"]
    assert kinds == ["no_loss", "no_gradients"]
    guard.close()


def test_user_unscale_before_step_is_explained_not_a_crash(tmp_path):
    sink = gg.MemorySink()
    torch.manual_seed(0)
    model = TinyNet()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu")
    guard = gg.Guard(model, opt, scaler=scaler,
                     config=gg.GuardConfig.preset("default", output={"console": False, "jsonl": False}), sinks=[sink])
    gen = torch.Generator().manual_seed(0)
    with pytest.warns(UserWarning, match=r"scaler.unscale_\(optimizer\) was called before guard.step.*Fix: remove"):
        for _ in range(3):
            loss = model(*make_batch(gen))
            scaler.scale(loss).backward()
            scaler.unscale_(opt)  # the user's habit from the AMP recipe
            rep = guard.step(loss)
            opt.zero_grad()
            assert rep.applied and rep.total_norm < 100  # measured unscaled, once
    assert [e["kind"] for e in sink.events if e["type"] == "misuse"] == ["user_unscale"]
    guard.close()


def test_users_own_clipping_before_step_is_explained_once(tmp_path):
    sink = gg.MemorySink()
    torch.manual_seed(0)
    model = TinyNet()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    cfg = gg.GuardConfig.preset("default", output={"console": False, "jsonl": False})
    guard = gg.Guard(model, opt, config=cfg, sinks=[sink])
    gen = torch.Generator().manual_seed(0)
    norms = []
    with pytest.warns(UserWarning, match=r"exactly 0.5 in 3 of the last.*Fix: remove your clip_grad_norm_"):
        for _ in range(6):
            loss = model(*make_batch(gen)) * 50  # large gradients: every step is clipped
            loss.backward()
            norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)))
            guard.step(loss)
            opt.zero_grad()
    assert min(norms) > 0.5  # they really were clipped
    assert [e["kind"] for e in sink.events if e["type"] == "misuse"] == ["user_clip"]
    guard.close()
    # in monitor mode clipping is the user's job: no warning
    mon = gg.Guard(model, opt, config=gg.GuardConfig.preset("monitor", output={"console": False, "jsonl": False}))
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for _ in range(6):
            loss = model(*make_batch(gen)) * 50
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
            mon.step(loss)
            opt.zero_grad()
    mon.close()
    # unclipped training never trips it
    torch.manual_seed(0)
    model = TinyNet()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    guard = gg.Guard(model, opt, config=cfg)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for _ in range(30):
            loss = model(*make_batch(gen))
            loss.backward()
            guard.step(loss)
            opt.zero_grad()
    guard.close()


def test_gradscaler_in_use_but_not_passed_to_the_guard_is_explained_once(tmp_path):
    import gc

    sink = gg.MemorySink()
    torch.manual_seed(0)
    model = TinyNet()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu")  # the AMP recipe's scaler, forgotten in Guard(...)
    guard = gg.Guard(model, opt, config=gg.GuardConfig.preset("default", output={"console": False, "jsonl": False}),
                     sinks=[sink])
    gen = torch.Generator().manual_seed(0)
    with pytest.warns(UserWarning, match=r"GradScaler \(scale 65536\) scaled the loss but was not passed to the "
                                         r"Guard.*Fix: Guard\(model, optimizer, scaler=scaler\)") as rec:
        for _ in range(3):
            loss = model(*make_batch(gen))
            scaler.scale(loss).backward()
            guard.step(loss)
            opt.zero_grad()
    assert sum("not passed to the Guard" in str(w.message) for w in rec) == 1  # once
    assert [e["kind"] for e in sink.events if e["type"] == "misuse"] == ["scaler_not_passed"]
    guard.close()
    del scaler
    gc.collect()
    # huge gradients without any GradScaler in the process: no such warning
    import warnings

    torch.manual_seed(0)
    model = TinyNet()
    opt = torch.optim.SGD(model.parameters(), lr=1e-6)
    guard = gg.Guard(model, opt, config=gg.GuardConfig.preset("default", output={"console": False, "jsonl": False}))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(3):
            loss = model(*make_batch(gen)) * 1e5
            loss.backward()
            guard.step(loss)
            opt.zero_grad()
    assert not [w for w in caught if "GradScaler" in str(w.message)]
    guard.close()


# -- every class of bad setup: one error naming the field or object, the value and the fix -----------------
def _not_a_module(tmp_path):
    gg.Guard(object(), torch.optim.SGD(TinyNet().parameters(), lr=0.1))


def _optimizer_of_another_model(tmp_path):
    gg.Guard(TinyNet(), torch.optim.SGD(TinyNet().parameters(), lr=0.1))


def _second_acting_guard(tmp_path):
    guard, model, opt = _guard(tmp_path)
    gg.Guard(model, opt, config=guard.config)


def _closure_optimizer(tmp_path):
    model = TinyNet()
    gg.Guard(model, torch.optim.LBFGS(model.parameters()))


def _accumulate_without_controller(tmp_path):
    guard, model, _ = _guard(tmp_path)
    guard.accumulate([], lambda mb: model(*mb))


def _injector_step(tmp_path):
    from gradguard.testing import NaNLoss

    NaNLoss(at_step=0)


def _injector_layer(tmp_path):
    from gradguard.testing import GradFault

    GradFault("transformer.h.3", at_step=2).attach(TinyNet())


def _io_fault_without_guard(tmp_path):
    from gradguard.testing import SnapshotIOFault

    SnapshotIOFault(at_step=2).attach(TinyNet())


def _config_bool(tmp_path):
    gg.GuardConfig.from_dict({"output": {"console": "false"}})


def _config_number(tmp_path):
    gg.GuardConfig.from_dict({"adam": {"eps": "tiny"}})


def _loss_as_a_list(tmp_path):
    guard, model, _ = _guard(tmp_path)
    loss = model(*make_batch(torch.Generator().manual_seed(0)))
    loss.backward()
    guard.step([loss])


def _step_after_close(tmp_path):
    guard, model, _ = _guard(tmp_path)
    guard.close()
    loss = model(*make_batch(torch.Generator().manual_seed(0)))
    loss.backward()
    guard.step(loss)


def _yaml_preset_malformed_section(tmp_path):
    pytest.importorskip("yaml")
    path = tmp_path / "guard.yaml"
    path.write_text("preset: default\nclip: 5\n")
    gg.GuardConfig.from_yaml(str(path))


def _lightning_two_default_callbacks(tmp_path):
    L = pytest.importorskip("lightning.pytorch")
    from gradguard.lightning import GradGuardCallback

    from .engines import cfg

    L.Trainer(callbacks=[GradGuardCallback(cfg(tmp_path)), GradGuardCallback(cfg(tmp_path))], logger=False,
              enable_progress_bar=False, enable_model_summary=False, default_root_dir=str(tmp_path))


def _hf_same_callback_twice(tmp_path):
    pytest.importorskip("transformers")
    from transformers import Trainer, TrainingArguments

    from gradguard.hf import GradGuardCallback

    from .engines import Data, Net, cfg

    cb = GradGuardCallback(config=cfg(tmp_path))
    args = TrainingArguments(output_dir=str(tmp_path / "hf"), use_cpu=True, report_to=[], max_steps=1,
                             save_strategy="no", disable_tqdm=True)
    Trainer(model=Net(), args=args, train_dataset=Data(), callbacks=[cb, cb])


def _engine_closure(engine):
    def run(tmp_path):
        from .engines import RUNNERS, cfg

        RUNNERS[engine](tmp_path, cfg(tmp_path), steps=1, opt_kind="lbfgs")
    return run


# (id, the mistake, the error class, the object or field named, the value quoted)
BAD_SETUPS = [
    ("model-not-a-module", _not_a_module, gg.UnsupportedSetupError, "model=", "object"),
    ("optimizer-of-another-model", _optimizer_of_another_model, gg.UnsupportedSetupError, "optimizer",
     "trainable parameters"),
    ("second-acting-guard", _second_acting_guard, AttachError, "optimizer=AdamW", "already has an acting guard"),
    ("closure-optimizer", _closure_optimizer, AttachError, "optimizer=LBFGS", "needs a closure"),
    ("closure-optimizer-hf", _engine_closure("hf"), gg.UnsupportedSetupError, "optimizer=LBFGS", "needs a closure"),
    ("closure-optimizer-lightning", _engine_closure("lightning"), gg.UnsupportedSetupError, "optimizer=LBFGS",
     "needs a closure"),
    ("accumulate-without-controller", _accumulate_without_controller, gg.ConfigError, "Guard.accumulate",
     "batch controller"),
    ("injector-step", _injector_step, gg.ConfigError, "NaNLoss.at_step", "0"),
    ("injector-layer", _injector_layer, gg.ConfigError, "GradFault.layer", "'transformer.h.3'"),
    ("io-fault-without-guard", _io_fault_without_guard, gg.ConfigError, "SnapshotIOFault(target='snapshots')",
     "guard=None"),
    ("config-bool", _config_bool, gg.ConfigError, "GuardConfig.output.console", "'false'"),
    ("config-number", _config_number, gg.ConfigError, "GuardConfig.adam.eps", "'tiny'"),
    # round three (issue 28): the errors name the field and the fix
    ("loss-as-a-list", _loss_as_a_list, gg.ConfigError, "guard.step(loss): loss=list", "is not a tensor"),
    ("step-after-close", _step_after_close, gg.GradGuardError, "guard.step()", "closed guard"),
    ("yaml-preset-malformed-section", _yaml_preset_malformed_section, gg.ConfigError, "GuardConfig.clip=5",
     "must be a dict of fields"),
    ("lightning-two-default-callbacks", _lightning_two_default_callbacks, gg.ConfigError,
     "2 GradGuardCallbacks named 'default'", "name='main'"),
    ("hf-same-callback-twice", _hf_same_callback_twice, gg.ConfigError, "same callback instance", "2 times"),
]


@pytest.mark.usefixtures("one_thread")
@pytest.mark.parametrize("name,mistake,error,names,value", BAD_SETUPS, ids=[b[0] for b in BAD_SETUPS])
def test_bad_setup_is_one_clear_error(tmp_path, name, mistake, error, names, value):
    """Bad guard states: BAD_STATES above; bad config fields: tests/test_config.py INVALID; snapshot
    files of another run or model: tests/test_reliability.py; resumed with a changed config (a
    warning per field): tests/test_resume_config.py."""
    with pytest.raises(error) as info:
        mistake(tmp_path)
    msg = str(info.value)
    assert names in msg and value in msg and "Fix:" in msg, msg
