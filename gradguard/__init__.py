"""gradguard: keeps neural-network training from blowing up.

Per-layer gradient norms, the loss and the loss scale are watched every step; a policy reacts
(skip, clip, lower the LR, adjust Adam, roll back, shrink the batch, or halt with a diagnosis).
"""

from .config import GuardConfig
from .core import StepReport
from .detect import Finding
from .errors import (
    ConfigError,
    GradGuardError,
    GradGuardHalt,
    GradGuardWarning,
    StateError,
    UnsupportedSetupError,
)
from .guard import Guard
from .policy import Action
from .sinks import ConsoleSink, JSONLSink, M, MemorySink, Sink, TensorBoardSink, WandbSink

__version__: str = __import__("gradguard.names", fromlist=["VERSION"]).VERSION  # metadata, else the literal

__all__ = [
    "Guard", "GuardConfig", "GradGuardError", "ConfigError", "UnsupportedSetupError", "StateError",
    "GradGuardHalt", "GradGuardWarning", "StepReport", "Finding",
    "Action", "Sink", "JSONLSink", "ConsoleSink", "MemorySink", "TensorBoardSink", "WandbSink", "M",
    "__version__",
]
