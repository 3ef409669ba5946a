"""pytest plugin: every ``lightning.pytorch.Trainer`` a test builds gets gradguard's Lightning
callback (``GG_ATTACH=monitor|default``); without ``GG_ATTACH`` it does nothing (the baseline).
Used by ``run_lightning.sh`` on Lightning's own ``tests/tests_pytorch``."""

from __future__ import annotations

import os

MODE = os.environ.get("GG_ATTACH", "")


def pytest_configure(config):  # noqa: ARG001 - pytest's hook signature
    if not MODE:
        return
    import lightning.pytorch as pl

    import gradguard as gg
    from gradguard.lightning import GradGuardCallback

    original = pl.Trainer.__init__

    def init(self, *args, **kwargs):
        callbacks = kwargs.get("callbacks")
        if callbacks is None:
            callbacks = []
        elif not isinstance(callbacks, (list, tuple)):
            callbacks = [callbacks]
        guard = GradGuardCallback(gg.GuardConfig.preset(MODE, output={"console": False}))
        kwargs["callbacks"] = [*callbacks, guard]
        original(self, *args, **kwargs)

    pl.Trainer.__init__ = init
