"""Clean end of a multi-process test worker."""

from __future__ import annotations

import torch


def shutdown() -> None:
    """Free the process group while the interpreter is whole, after every rank is done with it.

    Call it after the trainer, the model and everything that refers to them (the DDP wrapper, the
    engine, the callbacks) are out of scope. The DDP wrapper's reducer holds a reference to the
    gloo process group, so ``destroy_process_group`` alone does not free it: the group, and its
    gloo transport threads, then die during interpreter teardown, where a still-joinable thread
    aborts the rank (``terminate called without an active exception``, SIGABRT) after its work is
    done, and torchrun fails the whole job. Collecting the wrapper first makes the destroy the
    last reference: the group's destructor joins its threads while Python is still running."""
    import gc

    gc.collect()  # the DDP reducer (and its reference to the group) sits in reference cycles
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
    gc.collect()
