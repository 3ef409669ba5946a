"""Metric names: one source of truth for the sinks, the dashboards and the tests
(``gradguard.M``; also importable as ``gradguard.sinks.M``)."""

from __future__ import annotations

__all__ = ["M", "VERSION"]


def _version() -> str:
    """The installed distribution's version (package metadata), else the source tree's literal."""
    try:
        from importlib.metadata import version

        return version("gradguard")
    except Exception:  # noqa: BLE001 - not installed (a source checkout on sys.path)
        return "0.1.0"


VERSION = _version()
"""``gradguard.__version__``."""


class M:
    """Metric names (slash-separated, no dots). Per-layer names append ``/<layer>``."""

    LOSS = "gradguard/loss"  # the step's loss (mean over its micro-batches), in every sink and engine
    LOSS_WINDOW_MEAN = "gradguard/loss_window_mean"  # HF: mean step loss of the logging window (HF's own "loss")
    GRAD_NORM = "gradguard/grad_norm/total"
    GRAD_NORM_LAYER = "gradguard/grad_norm"  # + /<layer>
    PARAM_NORM_LAYER = "gradguard/param_norm"  # + /<layer>
    UPDATE_RATIO_LAYER = "gradguard/update_ratio"  # + /<layer>
    LR = "gradguard/lr"  # + /group<i>: the applied LR (the scheduler's x the multiplier)
    LR_LOG10 = "gradguard/lr_log10"  # + /group<i>: log10 of the applied LR (TensorBoard's layout has no log axis)
    LR_SCHEDULED = "gradguard/lr_scheduled"  # + /group<i>: the scheduler's LR, before the multiplier
    LR_MULT = "gradguard/lr_multiplier"
    MAX_NORM = "gradguard/max_grad_norm"
    SCALE = "gradguard/loss_scale"
    OVERFLOW = "gradguard/overflow"
    SKIPPED = "gradguard/skipped_steps"
    NONFINITE_LOSS_STEPS = "gradguard/nonfinite_loss_steps"
    FINDINGS = "gradguard/findings"
    ACTION = "gradguard/action"  # + /<name>: cumulative count
    LEVEL = "gradguard/ladder_level"
    EVENT = "gradguard/event"  # + /<finding kind, action name, skip or halt>: the step's loss (a point on the loss curve)
    ALERTS_TEXT = "gradguard/alerts"  # TensorBoard text tag of the alerts
    EVENT_POINTS = "gradguard/event_points"  # W&B: the events as a scatter chart (its table: + "_table")
