"""One error hierarchy: every deliberate error is a GradGuardError and keeps its old built-in base."""

from __future__ import annotations

import pickle
import warnings

import pytest
import torch

import gradguard as gg
from gradguard import errors
from gradguard.data import BatchController


def test_hierarchy_keeps_the_builtin_bases():
    assert issubclass(gg.ConfigError, gg.GradGuardError) and issubclass(gg.ConfigError, ValueError)
    assert issubclass(gg.UnsupportedSetupError, gg.ConfigError)
    assert issubclass(gg.UnsupportedSetupError, TypeError) and issubclass(gg.UnsupportedSetupError, ValueError)
    assert issubclass(gg.GradGuardHalt, gg.GradGuardError) and issubclass(gg.GradGuardHalt, RuntimeError)
    assert issubclass(gg.StateError, gg.GradGuardError) and issubclass(gg.StateError, ValueError)
    from gradguard.guard import GradGuardHalt

    assert GradGuardHalt is gg.GradGuardHalt  # still importable from its old home


def test_halt_pickles_with_its_diagnosis():
    exc = gg.GradGuardHalt({"step": 7, "reason": "why", "actions_tried": {"rollback": 2}})
    back = pickle.loads(pickle.dumps(exc))
    assert back.diagnosis == exc.diagnosis and str(back) == str(exc) and "rollback x2" in str(back)


def test_user_mistakes_raise_gradguard_errors(tiny):
    opt = torch.optim.SGD(tiny.parameters(), lr=0.1)
    with pytest.raises(gg.UnsupportedSetupError, match="not a torch.nn.Module"):
        gg.Guard(object(), opt)  # type: ignore[arg-type]
    with pytest.raises(gg.UnsupportedSetupError, match="not a torch.optim.Optimizer"):
        gg.Guard(tiny, object())  # type: ignore[arg-type]
    other = torch.nn.Linear(2, 2)
    with pytest.raises(gg.UnsupportedSetupError, match="none of the model's trainable parameters"):
        gg.Guard(other, opt, config=gg.GuardConfig.preset("default", output={"jsonl": False, "console": False}))
    with pytest.raises(errors.ConfigTypeError):
        gg.GuardConfig.coerce(3)  # type: ignore[arg-type]
    with pytest.raises(gg.ConfigError, match="batch_size"):
        BatchController(list(range(4)), 0)
    g = gg.Guard(tiny, opt, config=gg.GuardConfig.preset("default", output={"jsonl": False, "console": False}))
    with pytest.raises(gg.StateError, match="state version"):
        g.load_state_dict({"version": 999})


def test_warnings_come_from_rank_zero_only(monkeypatch):
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        errors.warn("gradguard: from rank 1")
    assert not seen
    monkeypatch.setenv("RANK", "0")
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        errors.warn("gradguard: from rank 0")
        errors.warn_once("k-test", "gradguard: once")
        errors.warn_once("k-test", "gradguard: once")
    assert [str(w.message) for w in seen] == ["gradguard: from rank 0", "gradguard: once"]
    assert all(issubclass(w.category, gg.GradGuardWarning) for w in seen)


def test_a_missing_private_attribute_disables_its_action_with_one_warning_naming_versions():
    import types

    from gradguard import _compat

    trainer = types.SimpleNamespace(fit_loop=types.SimpleNamespace(max_batches=10),  # no _combined_loader
                                    checkpoint_callbacks=[types.SimpleNamespace()])  # no _last_global_step_saved
    errors._WARNED.discard("compat:lightning:batch_resize")
    errors._WARNED.discard("compat:lightning:checkpoint_rollback")
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        first = _compat.check_features("lightning", trainer)
        second = _compat.check_features("lightning", trainer)
    assert set(first) == set(second) == {"batch_resize", "checkpoint_rollback"}
    texts = [str(w.message) for w in seen]
    assert len(texts) == 2  # once per action and process, not per call
    assert all("torch " + torch.__version__ in t and "is disabled" in t for t in texts)
    assert any("'batch_resize'" in t for t in texts) and any("'checkpoint_rollback'" in t for t in texts)


def test_a_stray_rank_without_a_world_does_not_silence_a_single_process(monkeypatch):
    """``RANK=3`` left in the environment of one process (no torch.distributed, no WORLD_SIZE>1):
    it is rank 0 and warns; RANK is trusted only with a consistent WORLD_SIZE > 1."""
    for env, rank0 in (({"RANK": "3"}, True), ({"RANK": "3", "WORLD_SIZE": "1"}, True),
                       ({"RANK": "3", "WORLD_SIZE": "2"}, True),  # inconsistent: rank >= world
                       ({"RANK": "x", "WORLD_SIZE": "4"}, True), ({"RANK": "3", "WORLD_SIZE": "4"}, False),
                       ({"RANK": "0", "WORLD_SIZE": "4"}, True)):
        monkeypatch.delenv("RANK", raising=False)
        monkeypatch.delenv("WORLD_SIZE", raising=False)
        for k, v in env.items():
            monkeypatch.setenv(k, v)
        assert errors.is_rank0() is rank0, env
    monkeypatch.setenv("RANK", "3")
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        errors.warn("gradguard: stray RANK")
    assert [str(w.message) for w in seen] == ["gradguard: stray RANK"]


def test_a_warning_points_at_the_users_line_and_goes_through_the_logger(tiny, caplog):
    """A misuse warning raised deep inside gradguard names this file and line (the user's
    ``guard.step`` call), not gradguard's source; the same text is a record of the logger."""
    import logging

    opt = torch.optim.SGD(tiny.parameters(), lr=0.1)
    guard = gg.Guard(tiny, opt, config=gg.GuardConfig.preset("default", output={"jsonl": False, "console": False}))
    errors._WARNED.clear()
    with warnings.catch_warnings(record=True) as seen, caplog.at_level(logging.WARNING, logger="gradguard"):
        warnings.simplefilter("always")
        for _ in range(4):  # no loss given, backward() forgotten
            line = __import__("inspect").currentframe().f_lineno + 1
            guard.step()
            opt.zero_grad()
    mine = [w for w in seen if issubclass(w.category, gg.GradGuardWarning)]
    assert mine, [str(w.message) for w in seen]
    assert all(w.filename == __file__ for w in mine), [(w.filename, w.lineno) for w in mine]
    assert line in {w.lineno for w in mine}
    assert {r.getMessage() for r in caplog.records if r.name == "gradguard"} >= {str(w.message) for w in mine}


def test_the_loggers_level_quiets_warnings_and_the_console(capsys):
    import io
    import logging

    stream = io.StringIO()
    sink = gg.ConsoleSink(stream=stream, write=lambda line, s: s.write(line + "\n"))
    log = logging.getLogger("gradguard")
    old = log.level
    try:
        log.setLevel(logging.ERROR)
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            errors.warn("gradguard: quiet please")
        sink.log_event({"type": "halt", "step": 3, "message": "stop"})
        assert not seen and stream.getvalue() == ""
        log.setLevel(logging.NOTSET)
        sink.log_event({"type": "halt", "step": 3, "message": "stop"})
        assert "HALT at step 3" in stream.getvalue()
    finally:
        log.setLevel(old)
