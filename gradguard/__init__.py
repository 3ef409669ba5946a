"""gradguard: keeps neural-network training from blowing up.

Per-layer gradient norms, the loss and the loss scale are watched every step; a policy reacts
(skip, clip, lower the LR, adjust Adam, roll back, shrink the batch, or halt with a diagnosis).
"""

from .config import ConfigError, GuardConfig
from .detect import Finding
from .guard import GradGuardHalt, Guard, GuardCore, StepReport
from .policy import Action
from .sinks import ConsoleSink, JSONLSink, M, MemorySink, Sink, TensorBoardSink, WandbSink

__version__ = "0.1.0"

__all__ = [
    "Guard", "GuardCore", "GuardConfig", "ConfigError", "GradGuardHalt", "StepReport", "Finding",
    "Action", "Sink", "JSONLSink", "ConsoleSink", "MemorySink", "TensorBoardSink", "WandbSink", "M",
    "__version__",
]
