"""``GradGuardCallback`` for the standalone ``pytorch_lightning`` package.

``from gradguard.pytorch_lightning import GradGuardCallback`` when your Trainer comes from
``pytorch_lightning``; ``gradguard.lightning`` serves ``lightning.pytorch``. Same callback, same
behaviour: see :mod:`gradguard.lightning`.
"""

from __future__ import annotations

try:
    import pytorch_lightning as _pl
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise ImportError("gradguard.pytorch_lightning needs pytorch_lightning: pip install pytorch-lightning "
                      "(or use gradguard.lightning with the lightning package)") from exc

from .lightning import LightningLoggerSink, make_callback_class

__all__ = ["GradGuardCallback", "LightningLoggerSink"]

GradGuardCallback = make_callback_class(_pl)
