"""What in a Trainer setup gradguard cannot guard, and the Trainer's log entries."""

from __future__ import annotations

import math
import os
from typing import Any

from ..adapter import engine_refusal

__all__ = ["unsupported", "log_entries", "tensorboard_dir"]

_UNSKIPPABLE_OPTIMS = ("lomo", "adalomo")  # update inside backward: no optimizer step to skip
def unsupported(args: Any, optimizer: Any) -> dict[str, str]:
    """What in this Trainer setup gradguard cannot guard (see ``gradguard.adapter.refuse_unsupported``)."""
    out: dict[str, str] = {}
    if getattr(args, "deepspeed", None) or getattr(args, "deepspeed_plugin", None) is not None:
        ds = args.deepspeed
        clip = ds.get("gradient_clipping") if isinstance(ds, dict) else None
        out.update(engine_refusal("deepspeed", f"TrainingArguments.deepspeed={ds!r}",
                                  f" (gradient_clipping={clip!r})"))
    if getattr(args, "fsdp", None) and args.fsdp not in ("", [], None):
        out.update(engine_refusal("fsdp", f"TrainingArguments.fsdp={args.fsdp!r}"))
    optim_name = str(getattr(args, "optim", "")).lower()
    if any(optim_name.endswith(n) or optim_name == n for n in _UNSKIPPABLE_OPTIMS):
        out[f"TrainingArguments.optim={args.optim!r}"] = (
            "this optimizer updates the weights during backward, so a poisoned step cannot be skipped. Fix: use an "
            "optimizer with a step() (e.g. optim='adamw_torch')")
    if optimizer is not None and hasattr(optimizer, "param_groups"):
        from ..act import unwrap_optimizer
        from ..misuse import closure_refusal

        out.update(closure_refusal(unwrap_optimizer(optimizer)))
    if optimizer is None or not hasattr(optimizer, "param_groups"):
        out[f"optimizer={type(optimizer).__name__}"] = (
            "gradguard needs a torch optimizer with param_groups (to skip a step, apply LR multipliers and change "
            "Adam's betas). Fix: use a torch.optim optimizer")
    return out


def log_entries(metrics: dict[str, float], window: list[float], layer_metrics: bool, nonfinite_key: str) -> dict[str, float]:
    """The ``gradguard/...`` entries added to one Trainer log: the core's metrics (per-layer values
    only with ``layer_metrics``), the mean guard loss of the logging window (nan/inf stay visible)
    and the number of its non-finite steps."""
    m = dict(metrics)
    if not layer_metrics:
        m = {k: v for k, v in m.items() if k.count("/") < 2 or k.startswith("gradguard/lr/")
             or k.startswith("gradguard/action/") or k.endswith("/total")}
    if window:
        m["gradguard/loss"] = sum(window) / len(window)
        m[nonfinite_key] = float(sum(not math.isfinite(v) for v in window))
    else:
        m.pop("gradguard/loss", None)  # no step of this logging window was computed (a skipped data window)
    return m


def tensorboard_dir(callbacks: list[Any] | None, args: Any) -> str | None:
    """The Trainer's logging directory: the TensorBoard integration's (``TENSORBOARD_LOGGING_DIR``,
    else ``<output_dir>/runs/<time>_<host>``), None when the Trainer does not report to TensorBoard
    (transformers 5 has no ``TrainingArguments.logging_dir``). This callback runs before the
    reporters, so the default folder is computed here as the integration computes it and handed
    to it: both write to the same folder."""
    try:
        from transformers.integrations import TensorBoardCallback
        from transformers.integrations.integration_utils import default_logdir
    except ImportError:  # pragma: no cover - an older transformers
        return None
    tb = next((c for c in callbacks or [] if isinstance(c, TensorBoardCallback)), None)
    if tb is None:
        return None
    if getattr(tb, "logging_dir", None) is None:
        tb.logging_dir = os.path.join(args.output_dir, default_logdir())
    return str(tb.logging_dir)
