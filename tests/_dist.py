"""Clean end of a multi-process test worker."""

from __future__ import annotations

import torch


def shutdown() -> None:
    """Wait for every rank, then destroy the process group before the interpreter exits.

    Without this, gloo's worker threads are still alive when Python tears the process down, and a
    rank can abort with ``terminate called without an active exception`` (SIGABRT) after its work is
    done, which fails the whole torchrun job."""
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
