"""pytest plugin for running transformers' own Trainer tests with gradguard attached.

``GG_ATTACH=monitor|default``: every ``transformers.Trainer`` built in the session gets
``gradguard.hf.GradGuardCallback(GuardConfig.preset(GG_ATTACH, output={"console": False}))``
appended to its callbacks. Without ``GG_ATTACH`` the Trainer is left alone (the baseline run).

``GG_RECORD=<file.jsonl>``: after every ``Trainer.train()`` returns, one JSON line with the test id,
the Trainer's index within the test, its ``log_history`` (timing keys and gradguard's own
``gradguard/*`` keys removed), a digest of the final parameters, the ``TrainingArguments`` and,
when attached, the guard's summary. ``compare.py`` diffs these between the runs, so a change that
no assertion of the suite looks at (a weight, a logged value, an argument left mutated) shows too.

Load it with ``-p hf_attach`` and ``PYTHONPATH`` containing this folder (``run_hf.sh`` does).
"""

from __future__ import annotations

import hashlib
import inspect
import json
import os
from typing import Any

MODE = os.environ.get("GG_ATTACH", "")
RECORD = os.environ.get("GG_RECORD", "")
_TIMING = ("runtime", "per_second", "total_flos")
_current: dict[str, Any] = {"test": None, "n": 0}


def pytest_runtest_setup(item: Any) -> None:
    _current["test"] = item.nodeid
    _current["n"] = 0


def _digest(model: Any) -> str:
    h = hashlib.sha256()
    for name, p in sorted(model.state_dict().items()):
        h.update(name.encode())
        h.update(p.detach().cpu().contiguous().float().numpy().tobytes())
    return h.hexdigest()[:16]


def _plain(v: Any) -> Any:
    return v if isinstance(v, (int, float, str, bool, type(None))) else str(v)


def _record(trainer: Any) -> None:
    _current["n"] += 1
    rec: dict[str, Any] = {
        "test": _current["test"], "n": _current["n"], "global_step": trainer.state.global_step,
        "log_history": [{k: v for k, v in e.items()
                         if not k.startswith("gradguard/") and not any(t in k for t in _TIMING)}
                        for e in trainer.state.log_history],
        "params": _digest(trainer.model),
        "args": {k: _plain(v) for k, v in trainer.args.to_dict().items()},
    }
    for cb in trainer.callback_handler.callbacks:
        if type(cb).__name__ == "GradGuardCallback":
            summary = getattr(cb, "summary", None) or {}
            rec["guard"] = {k: summary.get(k) for k in ("skipped", "findings", "actions", "lr_multiplier",
                                                        "max_grad_norm")}
    with open(RECORD, "a", encoding="utf-8") as f:
        f.write(json.dumps(rec, default=str) + "\n")


def pytest_configure(config: Any) -> None:
    import transformers

    if RECORD:
        train = transformers.Trainer.train

        def recorded_train(self: Any, *args: Any, **kwargs: Any) -> Any:
            out = train(self, *args, **kwargs)
            try:
                _record(self)
            except Exception as e:  # recording never changes a test's outcome
                print(f"hf_attach: record failed: {e!r}")
            return out

        transformers.Trainer.train = recorded_train

    if not MODE:
        return

    import gradguard as gg
    from gradguard.hf import GradGuardCallback

    init = transformers.Trainer.__init__
    sig = inspect.signature(init)

    def attached_init(self: Any, *args: Any, **kwargs: Any) -> None:
        bound = sig.bind(self, *args, **kwargs)
        callbacks = list(bound.arguments.get("callbacks") or [])
        callbacks.append(GradGuardCallback(gg.GuardConfig.preset(MODE, output={"console": False})))
        bound.arguments["callbacks"] = callbacks
        init(*bound.args, **bound.kwargs)

    transformers.Trainer.__init__ = attached_init
