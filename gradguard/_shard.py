"""Sharded training (FSDP2, FSDP1 with or without ``use_orig_params``): gradients, weights and
optimizer state of which each process holds a piece. An FSDP1 flat parameter
(``use_orig_params=False``) is measured per original parameter, on the slices of its local shard
that :class:`gradguard.measure.LayerMap` keeps per entry.

* Norms: every process measures its local pieces. Each piece's squared norm is weighted by
  ``world / copies`` (``copies``: how many processes hold that same piece: 1 when fully sharded,
  the replica count under hybrid sharding, the world under replication), so that the step's one
  mean all-reduce (the contract's :class:`gradguard.contract.Collective`, which already carries the
  loss and the loss scale) yields the exact global sums: no collective per layer, none extra.
* Snapshots: each process copies and restores its own pieces (local tensors, as plain tensors:
  one file per rank on disk, loadable with ``weights_only=True``); on restore they are wrapped
  back into the live parameters' layout.

Private torch pieces (FSDP1 unit settings) are read through :mod:`gradguard._compat`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from ._compat import dtensor_type, fsdp1_flat_pieces, fsdp1_shard_size, fsdp1_units, is_flat_param, placement_shards

__all__ = ["Sharding", "sharding", "zero_touching", "unsupported_sharding", "local_state", "rewrap_state",
           "rewrap_optimizer_state", "model_state", "load_model_state", "local_pieces"]


def _dtensor() -> type | None:
    return dtensor_type()


def unsupported_sharding(model: nn.Module) -> dict[str, str]:
    """``{setting: why and the fix}`` for sharded layouts gradguard cannot measure or restore:
    FSDP1 flat parameters (``use_orig_params=False``) are measured per original parameter through
    the flat parameter's private layout; a torch whose layout gradguard cannot read is refused."""
    if fsdp1_flat_pieces(model) is None:
        return {"FullyShardedDataParallel(use_orig_params=False)": (
            "this torch's FSDP1 flat parameters do not expose the layout gradguard reads (FlatParameter._fqns, "
            "_shapes, _param_infos, _shard_param_infos), so it cannot tell which layer a gradient belongs to. "
            "Fix: wrap with FullyShardedDataParallel(..., use_orig_params=True), or use FSDP2 "
            "(torch.distributed.fsdp.fully_shard)")}
    return {}


class Sharding:
    """How the watched tensors are spread over ``world`` processes; see the module docstring."""

    def __init__(self, world: int, plain_copies: int, reduce: Callable[[torch.Tensor], torch.Tensor] | None) -> None:
        self.world = world
        self.plain_copies = plain_copies
        """Processes holding the same piece of a plain (non-DTensor) tensor: FSDP1 shards by its shard
        group (world / group size copies), plain replicated tensors are on every process."""
        self.reduce = reduce
        self._weights: dict[tuple[float, ...], torch.Tensor] = {}

    def _copies(self, t: torch.Tensor) -> int:
        mesh, placements = t.device_mesh, t.placements  # type: ignore[attr-defined]
        copies = 1
        for dim, placement in enumerate(placements):
            if not placement_shards(placement):  # replicated (or pending a sum) along this mesh dimension
                copies *= mesh.size(dim)
        # a mesh smaller than the world (pipeline stages): ranks outside it hold other tensors
        return copies * max(1, self.world // max(1, mesh.size()))

    def localize(self, tensors: list[torch.Tensor]) -> tuple[list[torch.Tensor], torch.Tensor | None]:
        """(local pieces, per-piece weights of their squared norms, or None when all are 1)."""
        DTensor = _dtensor()
        out: list[torch.Tensor] = []
        weights: list[float] = []
        for t in tensors:
            if DTensor is not None and isinstance(t, DTensor):
                if any(pl.is_partial() for pl in t.placements):  # pending sums: finish them first (rare)
                    from torch.distributed.tensor import Replicate

                    t = t.redistribute(t.device_mesh, [Replicate() if pl.is_partial() else pl for pl in t.placements])
                weights.append(self.world / self._copies(t))
                out.append(t.to_local())
            else:
                weights.append(self.world / self.plain_copies)
                out.append(t)
        if all(w == 1.0 for w in weights):
            return out, None
        key = tuple(weights)
        device = out[0].device if out else torch.device("cpu")
        w = self._weights.get(key)
        if w is None or w.device != device:
            if len(self._weights) > 8:
                self._weights.clear()
            w = torch.tensor(weights, dtype=torch.float32, device=device)
            self._weights[key] = w
        return out, w

    def combine(self, layer_sq: torch.Tensor) -> torch.Tensor:
        """Weighted local per-layer squared norms -> global ones (one mean all-reduce), for the
        measurements made outside the step's packed reduction (log-interval parameter norms)."""
        return self.reduce(layer_sq) if self.reduce is not None and self.world > 1 else layer_sq


def sharding(model: nn.Module, world: int,
             reduce: Callable[[torch.Tensor], torch.Tensor] | None) -> Sharding | None:
    """The model's :class:`Sharding`, or None when no parameter is sharded (single process, DDP)."""
    DTensor = _dtensor()
    dtensors = DTensor is not None and any(isinstance(p, DTensor) for p in model.parameters())
    units = fsdp1_units(model)
    plain_copies = 1 * world
    if units:
        size = max(fsdp1_shard_size(u) for u in units)
        plain_copies = max(1, world // max(1, size))
    if not dtensors and plain_copies == world:
        return None
    return Sharding(world, plain_copies, reduce)


def zero_touching(params: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    """A zero loss whose backward reaches every parameter (its local piece when it is a DTensor),
    without a forward: a skipped data window under DDP/FSDP keeps every rank's backward in step
    (Lightning refuses a None loss there)."""
    DTensor = _dtensor()
    total = torch.zeros((), device=device, requires_grad=True)  # a loss to back through even when nothing is touched
    for p in params:
        if is_flat_param(p):
            # an FSDP1 flat parameter: outside FSDP's forward its storage is swapped between the
            # local shard and the gathered whole, so a graph on it cannot be backed through; without a
            # forward no FSDP1 collective runs on any rank, so nothing needs touching
            continue
        local = p.to_local() if DTensor is not None and isinstance(p, DTensor) else p
        if local.numel():
            total = total + local.reshape(-1)[:1].sum()
    return total * 0.0


def local_pieces(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """Each DTensor replaced by its local piece (which shares its storage: in-place work on it
    changes the DTensor); ``tensors`` itself when none is a DTensor."""
    DTensor = _dtensor()
    if DTensor is None or not any(isinstance(t, DTensor) for t in tensors):
        return tensors
    return [t.to_local() if isinstance(t, DTensor) else t for t in tensors]


# -- snapshots: each process keeps its own pieces -----------------------------------------------------
def local_state(obj: Any) -> Any:
    """``obj`` (a state dict, nested) with every DTensor replaced by its local piece (no copy)."""
    DTensor = _dtensor()
    if DTensor is None:
        return obj
    return _map(obj, lambda t: t.to_local() if isinstance(t, DTensor) else t)


def model_state(model: nn.Module) -> dict[str, Any]:
    """What a snapshot holds of ``model``: this process's own pieces, as plain tensors, without a
    collective. Under FSDP1 (units inside ``model``) that is each parameter's local data (the flat
    shard, or the ``use_orig_params`` views into it) and the buffers, read past FSDP1's
    ``state_dict()`` (which gathers the full weights on every rank); else ``model.state_dict()``
    with DTensors replaced by their local pieces."""
    if fsdp1_units(model):
        out: dict[str, Any] = {n: p.detach() for n, p in model.named_parameters()}
        out.update({n: b for n, b in model.named_buffers()})
        return out
    return local_state(model.state_dict())


@torch.no_grad()
def load_model_state(model: nn.Module, saved: dict[str, Any]) -> None:
    """Copy a :func:`model_state` back into ``model``'s live tensors (FSDP1: in place into each
    parameter's local data; DTensors: each piece wrapped back)."""
    if fsdp1_units(model):
        for name, t in [*model.named_parameters(), *model.named_buffers()]:
            t.copy_(saved[name])
        return
    model.load_state_dict(rewrap_state(saved, model.state_dict()))


def _map(obj: Any, fn: Callable[[torch.Tensor], Any]) -> Any:
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if isinstance(obj, dict):
        return {k: _map(v, fn) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_map(v, fn) for v in obj]
    if isinstance(obj, tuple):
        return tuple(_map(v, fn) for v in obj)
    return obj


def _like(local: torch.Tensor, live: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return DTensor.from_local(local.to(live.device), live.device_mesh, live.placements,  # type: ignore[attr-defined]
                              run_check=False, shape=live.shape, stride=live.stride())


def rewrap_state(saved: dict[str, Any], live: dict[str, Any]) -> dict[str, Any]:
    """A model state of local pieces (:func:`local_state`) in the layout of ``live`` (the model's
    state dict now): each piece wrapped back as a DTensor where the live tensor is one."""
    DTensor = _dtensor()
    if DTensor is None or not any(isinstance(v, DTensor) for v in live.values()):
        return saved
    return {k: _like(v, live[k]) if isinstance(live.get(k), DTensor) and isinstance(v, torch.Tensor)
            and not isinstance(v, DTensor) else v for k, v in saved.items()}


def rewrap_optimizer_state(saved: dict[str, Any], optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """An optimizer state of local pieces in the layout of ``optimizer``'s parameters: a state
    tensor shaped like its parameter's local piece becomes a DTensor like the parameter."""
    DTensor = _dtensor()
    params = [p for g in optimizer.param_groups for p in g["params"]]
    if DTensor is None or not any(isinstance(p, DTensor) for p in params):
        return saved
    ids = [i for g in saved.get("param_groups", []) for i in g.get("params", [])]
    state = dict(saved.get("state", {}))
    for idx, p in zip(ids, params):
        entry = state.get(idx)
        if not isinstance(p, DTensor) or not isinstance(entry, dict):
            continue
        local_shape = p.to_local().shape
        state[idx] = {k: _like(v, p) if isinstance(v, torch.Tensor) and not isinstance(v, DTensor)
                      and v.dim() > 0 and v.shape == local_shape else v for k, v in entry.items()}
    return {**saved, "state": state}
