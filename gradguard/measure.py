"""Per-layer gradient norms in one fused pass and one host-device sync per step."""

from __future__ import annotations

import math
import operator
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from itertools import repeat
from typing import Any

import torch
from torch import nn

from ._compat import device_dtype_groups, has_foreach_support
from .errors import UnsupportedSetupError

__all__ = ["default_layer_name", "LayerMap", "Measurement", "EngineClip", "GradMeasurer", "metric_key",
           "norm_layers", "is_norm_module", "fused_layer_sq_norms", "accumulation_dtype"]

_WRAPPER_PREFIXES = ("module.", "_orig_mod.", "_forward_module.", "_fsdp_wrapped_module.", "_checkpoint_wrapped_module.")


def default_layer_name(param_name: str) -> str:
    """Built-in grouping: module path up to and including the first numeric index
    (``transformer.h.3.attn.c_attn.weight`` -> ``transformer.h.3``), else the owning module
    (``lm_head.weight`` -> ``lm_head``). Wrapper prefixes (DDP, torch.compile, FSDP) are dropped."""
    name = param_name
    changed = True
    while changed:
        changed = False
        for prefix in _WRAPPER_PREFIXES:
            if name.startswith(prefix):
                name = name[len(prefix):]
                changed = True
        for inner in ("._orig_mod.", "._fsdp_wrapped_module.", "._checkpoint_wrapped_module."):
            name = name.replace(inner, ".")
    parts = name.split(".")
    for i, part in enumerate(parts[:-1]):
        if part.isdigit():
            return ".".join(parts[: i + 1])
    return ".".join(parts[:-1]) or parts[0]


def metric_key(layer: str) -> str:
    """A layer name as it appears in metric names: no dots (W&B globbing breaks on dots)."""
    return layer.replace(".", "_")


class LayerMap:
    """Assigns every trainable parameter of a model to a named layer.

    With ``optimizer`` the map follows it: parameters that become trainable after attach
    (unfrozen with ``requires_grad_()``, or added with ``optimizer.add_param_group``) join the
    map at the next :meth:`sync`. The re-check is cheap: the param groups' sizes, plus the
    ``requires_grad`` flag of optimizer parameters still frozen (none in most runs).

    A model whose parameters are all frozen when the guard attaches (a fine-tuning callback such
    as Lightning's ``BaseFinetuning`` freezes everything before training and unfreezes by epoch)
    starts with an empty map when ``optimizer`` holds some of them: they join when unfrozen."""

    def __init__(self, model: nn.Module,
                 layer_fn: Callable[[str], str] | str | None = None,
                 optimizer: torch.optim.Optimizer | None = None,
                 root: nn.Module | None = None) -> None:
        if isinstance(layer_fn, str):
            pattern = re.compile(layer_fn)

            def by_regex(name: str) -> str:
                m = pattern.search(name)
                if not m:
                    return default_layer_name(name)
                return m.group(1) if m.groups() else m.group(0)

            fn: Callable[[str], str] = by_regex
        else:
            fn = layer_fn or default_layer_name
        self._fn = fn
        self.model = model
        self.optimizer = optimizer
        self.params: list[nn.Parameter] = []
        self.param_names: list[str] = []
        self.layer_names: list[str] = []
        self.layer_index: list[int] = []
        self.version = 0
        """Bumped each time parameters join the map."""
        self._seen: dict[str, int] = {}
        self._ids: set[int] = set()
        self._frozen: list[nn.Parameter] = []  # optimizer parameters not yet trainable
        self._signature: tuple[int, ...] | None = None
        self.views: list[tuple[int, int] | None] = []
        """Per entry: None (the whole parameter), or ``(offset, numel)`` of one original parameter
        inside an FSDP1 flat parameter's local shard (``use_orig_params=False``): such a flat
        parameter has one entry per original parameter this process holds a piece of, each measured,
        tuned and normed on its own slice, so layers keep the unsharded model's names."""
        self.sliced = False
        """Whether some entry is a slice of an FSDP1 flat parameter."""
        self._unique: list[nn.Parameter] | None = None  # unique_params(), rebuilt when entries join
        self.flat_norm: dict[int, bool] = {}
        """Layers of FSDP1 flat parameters: whether each is made only of normalization parameters,
        from every original parameter (also those another process holds)."""
        self._add_flat(root if root is not None else model)
        self._add(p_name_pairs=[(n, p) for n, p in model.named_parameters() if p.requires_grad])
        if not self.params and (optimizer is None or not self._holds_model_params(optimizer)):
            raise UnsupportedSetupError("gradguard: the model has no trainable parameters (requires_grad=True); "
                             "attach the guard to the model being trained")
        if optimizer is not None:
            self._add_outside(optimizer)
            self._signature = self._opt_signature()
            self._frozen = [p for p in self._untracked_optimizer_params() if not p.requires_grad]

    def _add_outside(self, optimizer: torch.optim.Optimizer) -> list[str]:
        """Trainable parameters the optimizer steps that are not the model's (a learnable temperature
        or loss weight kept beside the model): each is an entry of its own layer, named from its
        place in the optimizer (``optimizer.param_groups[0].params[5]``), so its gradient is
        measured (a NaN there is caught like any other) and it is skipped, clipped and LR-scaled
        with the rest. None in most runs; the model's own parameters are matched by identity."""
        model_ids = {id(p) for p in self.model.parameters()}
        in_opt = [p for g in optimizer.param_groups for p in g["params"]]
        if not any(id(p) in model_ids for p in in_opt):
            return []  # an optimizer of another model: refused by the core (the wrong model was passed)
        pairs = []
        for gi, group in enumerate(optimizer.param_groups):
            for pi, p in enumerate(group["params"]):
                if isinstance(p, torch.Tensor) and p.requires_grad and id(p) not in self._ids and id(p) not in model_ids:
                    pairs.append((f"optimizer.param_groups[{gi}].params[{pi}]", p))
        added = []
        for name, p in pairs:
            if id(p) in self._ids:
                continue
            li = self._seen.get(name)
            if li is None:
                li = self._seen[name] = len(self.layer_names)
                self.layer_names.append(name)
            self._ids.add(id(p))
            self.params.append(p)
            self.param_names.append(name)
            self.layer_index.append(li)
            self.views.append(None)
            added.append(name)
        if added:
            self._unique = None
        return added

    def _layer(self, pname: str) -> int:
        layer = self._fn(pname)
        if layer not in self._seen:
            self._seen[layer] = len(self.layer_names)
            self.layer_names.append(layer)
        return self._seen[layer]

    def _add(self, p_name_pairs: list[tuple[str, nn.Parameter]]) -> list[str]:
        added = []
        for pname, p in p_name_pairs:
            if id(p) in self._ids:
                continue
            li = self._layer(pname)
            self._ids.add(id(p))
            self.params.append(p)
            self.param_names.append(pname)
            self.layer_index.append(li)
            self.views.append(None)
            added.append(pname)
        if added:
            self._unique = None
        return added

    def _add_flat(self, root: nn.Module) -> None:
        """FSDP1 flat parameters: every original parameter names its layer (on every process alike,
        so the layer list and the step's packed reduction line up across ranks); the pieces this
        process holds become entries. A layout gradguard cannot read is refused at attach
        (:func:`gradguard._shard.unsupported_sharding`)."""
        from ._compat import fsdp1_flat_pieces

        pieces = fsdp1_flat_pieces(root) or []
        for piece in pieces:
            if not piece.flat.requires_grad:
                continue
            li = self._layer(piece.name)
            # normalization-only layers from every piece, held here or not: the same on every process
            self.flat_norm[li] = self.flat_norm.get(li, True) and piece.module is not None \
                and is_norm_module(piece.module)
            if piece.numel == 0:
                continue  # the layer exists on every process; this one holds none of it
            self.params.append(piece.flat)
            self.param_names.append(piece.name)
            self.layer_index.append(li)
            self.views.append((piece.offset, piece.numel))
            self.sliced = True
        self._ids.update(id(piece.flat) for piece in pieces)

    def unique_params(self) -> list[nn.Parameter]:
        """The watched parameters, each once (an FSDP1 flat parameter has one entry per original
        parameter); kept until parameters join the map (do not modify the list)."""
        if not self.sliced:
            return self.params
        if self._unique is None:
            self._unique = list({id(p): p for p in self.params}.values())
        return self._unique

    def tensors(self, indices: Iterable[int] | None = None) -> list[torch.Tensor]:
        """The entries' values (detached; a flat parameter's slice as a view of its local shard)."""
        idx = range(len(self.params)) if indices is None else indices
        return [_entry(self.params[i].detach(), self.views[i]) for i in idx]

    def grads_of(self, indices: Iterable[int] | None = None) -> list[torch.Tensor | None]:
        """The entries' gradients (a flat parameter's slice as a view of its local gradient)."""
        idx = range(len(self.params)) if indices is None else indices
        out: list[torch.Tensor | None] = []
        for i in idx:
            g = self.params[i].grad
            out.append(None if g is None else _entry(g, self.views[i]))
        return out

    def entries_of(self, layers: Iterable[str]) -> list[int]:
        """Entry positions of the parameters of ``layers``."""
        wanted = {self.layer_names.index(n) for n in layers if n in self.layer_names}
        return [i for i, li in enumerate(self.layer_index) if li in wanted]

    def _holds_model_params(self, optimizer: torch.optim.Optimizer) -> bool:
        """Whether the optimizer holds any of the model's parameters, frozen or not."""
        in_opt = {id(p) for g in optimizer.param_groups for p in g["params"]}
        return any(id(p) in in_opt for p in self.model.parameters())

    def _opt_signature(self) -> tuple[int, ...]:
        assert self.optimizer is not None
        return tuple(len(g["params"]) for g in self.optimizer.param_groups)

    def _untracked_optimizer_params(self) -> list[nn.Parameter]:
        assert self.optimizer is not None
        return [p for g in self.optimizer.param_groups for p in g["params"] if id(p) not in self._ids]

    def sync(self) -> list[str]:
        """Add parameters that became trainable since the last call; returns their names."""
        if self.optimizer is None:
            return []
        signature = self._opt_signature()
        if signature == self._signature and not any(p.requires_grad for p in self._frozen):
            return []
        self._signature = signature
        in_opt = {id(p) for g in self.optimizer.param_groups for p in g["params"]}
        added = self._add([(n, p) for n, p in self.model.named_parameters()
                           if p.requires_grad and id(p) in in_opt])
        added += self._add_outside(self.optimizer)
        self._frozen = [p for p in self._untracked_optimizer_params() if not p.requires_grad]
        if added:
            self.version += 1
        return added

    def __len__(self) -> int:
        return len(self.layer_names)

    def params_of(self, layers: Iterable[str]) -> list[nn.Parameter]:
        """The parameters of ``layers`` (a flat parameter whole, once: see :meth:`entries_of`)."""
        seen: set[int] = set()
        out = []
        for i in self.entries_of(layers):
            p = self.params[i]
            if id(p) not in seen:
                seen.add(id(p))
                out.append(p)
        return out

    def match(self, pattern: str) -> list[str]:
        rx = re.compile(pattern)
        return [n for n in self.layer_names if rx.search(n)]


_NORM_TYPES: tuple[type, ...] = tuple(
    t for t in (nn.LayerNorm, nn.GroupNorm, nn.LocalResponseNorm, getattr(nn, "RMSNorm", None),
                nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d, nn.SyncBatchNorm)
    if isinstance(t, type))


def is_norm_module(module: nn.Module) -> bool:
    """A normalization layer: torch's norm modules, or a class named like one (``LlamaRMSNorm``,
    ``T5LayerNorm``, ``Qwen2RMSNorm``...), whose parameters only scale and shift."""
    name = type(module).__name__
    return isinstance(module, _NORM_TYPES) or name.endswith(("Norm", "Norm1d", "Norm2d", "Norm3d"))


def _entry(t: torch.Tensor, view: tuple[int, int] | None) -> torch.Tensor:
    return t if view is None else t.view(-1)[view[0]:view[0] + view[1]]


def norm_layers(model: nn.Module, layers: LayerMap) -> list[str]:
    """The layers of ``layers`` made only of normalization parameters (a final ``ln_f``)."""
    norm_ids = {id(p) for m in model.modules() if is_norm_module(m) for p in m.parameters(recurse=False)}
    owned: dict[int, bool] = dict(layers.flat_norm)  # the same on every process (see LayerMap._add_flat)
    for p, li, view in zip(layers.params, layers.layer_index, layers.views):
        if view is None:
            owned[li] = owned.get(li, True) and id(p) in norm_ids
    return [layers.layer_names[li] for li, only_norm in sorted(owned.items()) if only_norm]


def inner_norm_indices(model: nn.Module, layers: LayerMap) -> list[int]:
    """Positions in ``layers.params`` of the normalization parameters (batch norms left out: their
    gradient share is routine in CNNs), watched for a model with no standalone final norm (post-LN:
    every norm sits inside a block; the caller checks :func:`norm_layers`). Empty when parameters
    are sliced views."""
    if layers.sliced:
        return []
    ids = {id(p) for m in model.modules() if is_norm_module(m) and not isinstance(m, nn.modules.batchnorm._BatchNorm)
           for p in m.parameters(recurse=False)}
    return [i for i, p in enumerate(layers.params) if id(p) in ids]


@dataclass
class Measurement:
    """What one step's sync brought back to the host."""

    layer_norms: list[float]
    total_norm: float
    extras: list[float] = field(default_factory=list)
    nonfinite_layers: list[str] = field(default_factory=list)
    syncs: int = 1
    engine_norm: float | None = None
    """The engine's own total norm (``clip_grad_norm_``'s value, bit for bit) when an
    :class:`EngineClip` was measured."""
    engine_coef: float | None = None
    """``clip_grad_norm_``'s clamped coefficient for the engine's clip (1.0: nothing to scale)."""
    watched_norm: float | None = None
    """The L2 norm of the gradients of :attr:`GradMeasurer.watch` (None: nothing watched, or not
    measurable this step), from the same per-tensor norms."""


@dataclass
class EngineClip:
    """The engine's own norm pass (and clip), taken over by the measurement: ``params`` in the order
    the engine passes them to ``torch.nn.utils.clip_grad_norm_`` and the ``max_norm`` it clips to.
    The measurement then computes the per-tensor norms exactly as ``clip_grad_norm_`` does (native
    dtype, same kernels, same grouping by device and dtype) and derives both the per-layer values
    and the engine's total from them: one pass over the gradients instead of two, and
    :meth:`GradMeasurer.replay_clip` scales exactly as ``clip_grad_norm_`` would."""

    params: list[torch.Tensor]
    max_norm: float


def _norm_dtype(dtype: torch.dtype, native: bool) -> torch.dtype | None:
    """The dtype a gradient's norm is computed in: its own for 32- and 64-bit floats (and for every
    float when ``native``, as ``clip_grad_norm_`` computes it), float32 for 16-bit ones."""
    if native or dtype in (torch.float32, torch.float64) or not dtype.is_floating_point:
        return None
    return torch.float32


def _norms(tensors: list[torch.Tensor], dtype: torch.dtype | None, foreach: bool | None = None) -> list[torch.Tensor]:
    """L2 norm of each tensor (one fused kernel where ``clip_grad_norm_`` uses one; ``foreach``: that
    answer, already known)."""
    if foreach is None:
        foreach = bool(tensors) and has_foreach_support(tensors, tensors[0].device)
    if foreach:
        try:
            return list(torch._foreach_norm(tensors, 2, dtype=dtype))
        except Exception:  # noqa: BLE001 - an old or partial kernel: one norm per tensor below
            pass
    out = []
    for g in tensors:
        if g.is_sparse:
            g = g.coalesce()._values()
        out.append(torch.linalg.vector_norm(g, 2, dtype=dtype))
    return out


def _groups(tensors: list[torch.Tensor]) -> list[list[int]]:
    """Positions of ``tensors`` grouped by (device, dtype), in ``clip_grad_norm_``'s group order."""
    if len(tensors) < 2 or all(t.dtype == tensors[0].dtype and t.device == tensors[0].device for t in tensors):
        return [list(range(len(tensors)))]
    return device_dtype_groups(tensors)


def accumulation_dtype(tensors: Iterable[torch.Tensor]) -> torch.dtype:
    """float64 when any tensor is float64, else float32: the dtype per-layer sums are kept in."""
    return torch.float64 if any(t.dtype == torch.float64 for t in tensors) else torch.float32


def fused_layer_sq_norms(grads: list[torch.Tensor], groups: list[list[int]], index: torch.Tensor,
                         out: torch.Tensor, *, native: bool = False,
                         foreach: list[bool] | None = None,
                         weights: torch.Tensor | None = None,
                         stacks: list[torch.Tensor] | None = None) -> list[torch.Tensor | None]:
    """The step's one pass over the gradients: per-tensor L2 norms (one fused kernel per (device,
    dtype) group of ``groups``), squared and summed per layer into ``out`` (``out[l]`` = sum of the
    squared norms of the gradients whose ``index`` entry is ``l``; ``index`` follows the
    concatenation of ``groups``). ``out`` is zeroed here and sets the sums' device and dtype.

    Norms are computed in each gradient's own dtype for float32/float64 and in float32 for 16-bit
    gradients, unless ``native``: then in their own dtype too, exactly as ``clip_grad_norm_``
    computes them (so that the engine's total can be derived from them). ``foreach``: per group,
    whether the fused kernel applies (computed when not given). ``weights`` (in the order of
    ``grads``): factors of the squared norms (sharded gradients: a local shard's weight makes the
    step's mean reduction return the global sum). ``stacks``: a list that receives each group's
    norms stacked in their own dtype, as ``clip_grad_norm_`` stacks them. Returns the per-tensor
    norms in the order of ``grads``."""
    per_tensor: list[torch.Tensor | None] = [None] * len(grads)
    parts = []
    for k, positions in enumerate(groups):
        ts = grads if len(positions) == len(grads) else [grads[i] for i in positions]
        norms = _norms(ts, _norm_dtype(ts[0].dtype, native), None if foreach is None else foreach[k])
        for i, n in zip(positions, norms):
            per_tensor[i] = n
        stacked = torch.stack([n.to(norms[0].device) for n in norms]) if len(groups) > 1 else torch.stack(norms)
        if stacks is not None:
            stacks.append(stacked)
        if stacked.device != out.device or stacked.dtype != out.dtype:
            stacked = stacked.to(device=out.device, dtype=out.dtype, non_blocking=True)
        parts.append(stacked)
    sq = (parts[0] if len(parts) == 1 else torch.cat(parts)).square()
    if weights is not None:
        order = torch.tensor([i for positions in groups for i in positions], device=weights.device)
        sq = sq * weights.index_select(0, order).to(device=sq.device, dtype=sq.dtype)
    out.zero_().index_add_(0, index, sq)
    return per_tensor


class _Plan:
    """How one set of gradients is measured: (device, dtype) groups, the layer of each norm (in the
    groups' order) on the device, the dtype of the per-layer sums."""

    __slots__ = ("groups", "index", "device", "dtype", "foreach")

    def __init__(self, grads: list[torch.Tensor], owners: list[int]) -> None:
        self.groups = _groups(grads)
        self.foreach = [has_foreach_support([grads[i] for i in g], grads[g[0]].device) for g in self.groups]
        self.device = grads[0].device
        self.dtype = accumulation_dtype(grads)
        order = [owners[i] for g in self.groups for i in g]
        self.index = torch.tensor(order, device=self.device, dtype=torch.long)


class GradMeasurer:
    """Per-layer L2 norms of the current gradients (plus any extra scalars) in one transfer.

    The hot path allocates no host memory per step: the packed device buffer, the layer index and
    (on CUDA) a pinned host buffer and an event are kept; the single host read is one
    non-blocking copy into the pinned buffer and one wait on its event."""

    def __init__(self, layers: LayerMap) -> None:
        self.layers = layers
        self._plans: dict[Any, _Plan] = {}
        self._buf: torch.Tensor | None = None  # [layer sums | extras | engine total, coef]
        self._host: torch.Tensor | None = None  # pinned mirror of _buf (CUDA)
        self._event: Any = None
        self.last_grads: list[torch.Tensor] = []  # the gradients of the last measure(): the caller clears it
        self._engine_total: torch.Tensor | None = None  # the last EngineClip's total norm (device)
        self._engine: EngineClip | None = None
        self.transfers = 0  # host-device transfers made by measure(): one per call
        self.sharding: Any = None  # gradguard._shard.Sharding when parameters are sharded (FSDP)
        #: positions in ``layers.params`` whose gradients' joint norm is also packed (see ``watched_norm``)
        self.watch: list[int] = []
        self._watch_version = -1

    def set_watch(self, positions: list[int]) -> None:
        """Watch these positions of ``layers.params`` (for the current layer map; a change of the
        map makes the watched norm unmeasured until the positions are set again)."""
        self.watch, self._watch_version = list(positions), self.layers.version

    def grads(self) -> tuple[list[torch.Tensor], list[int]]:
        """The present gradients and the layer of each (do not modify the lists)."""
        sliced = self.layers.sliced
        grads = self.layers.grads_of() if sliced else [p.grad for p in self.layers.params]
        if all(map(operator.is_not, grads, repeat(None))):  # the usual step: every gradient present
            return grads, self.layers.layer_index  # type: ignore[return-value]
        present, owners = [], []
        for g, li in zip(grads, self.layers.layer_index):
            if g is not None:
                present.append(g)
                owners.append(li)
        return present, owners

    def _plan(self, grads: list[torch.Tensor], owners: list[int]) -> _Plan:
        g0 = grads[0]
        key = (self.layers.version, len(grads), g0.device, g0.dtype, grads[-1].dtype,
               None if len(grads) == len(self.layers.params) else tuple(owners))
        plan = self._plans.get(key)
        if plan is None:
            if len(self._plans) > 8:
                self._plans.clear()
            plan = self._plans[key] = _Plan(grads, owners)
        return plan

    def _buffer(self, device: torch.device, dtype: torch.dtype, size: int) -> torch.Tensor:
        buf = self._buf
        if buf is None or buf.device != device or buf.dtype != dtype or buf.numel() != size:
            buf = self._buf = torch.zeros(size, device=device, dtype=dtype)
            self._host = None
            if device.type == "cuda":
                self._host = torch.empty(size, dtype=dtype, pin_memory=True)
                self._event = torch.cuda.Event()
        return buf

    def _engine_total_of(self, engine: EngineClip, grads: list[torch.Tensor],
                         per_tensor: list[torch.Tensor | None],
                         stacks: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor] | None:
        """``clip_grad_norm_``'s total norm and clamped coefficient for the engine's parameters, from
        the norms just computed (None when the engine clips a gradient the layer map does not hold)."""
        params = engine.params
        if len(stacks) == 1 and len(params) == len(grads) == len(self.layers.params) \
                and all(map(operator.is_, params, self.layers.params)):
            # the usual case: the engine clips the layer map's parameters in the same order, all with
            # gradients, one (device, dtype) group: clip_grad_norm_'s stack is the one just made
            total = torch.linalg.vector_norm(stacks[0], 2)
        else:
            pos = {id(g): i for i, g in enumerate(grads)}
            engine_grads = [p.grad for p in params if p.grad is not None]
            if not engine_grads:
                return None
            picked = []
            for g in engine_grads:
                i = pos.get(id(g))
                if i is None:
                    return None
                picked.append(per_tensor[i])
            first = engine_grads[0].device
            norms = [picked[i] for grp in _groups(engine_grads) for i in grp]  # clip_grad_norm_'s order
            total = torch.linalg.vector_norm(torch.stack([n.to(first) for n in norms]), 2)  # type: ignore[union-attr]
        coef = torch.clamp(engine.max_norm / (total + 1e-6), max=1.0)
        return total, coef

    def measure(self, extras: Iterable[torch.Tensor | float | None] = (),
                reduce: Callable[[torch.Tensor], torch.Tensor] | None = None,
                engine: EngineClip | None = None) -> Measurement:
        """Squared per-layer norms and the extras are packed into one tensor; ``reduce`` (e.g. a
        DDP all-reduce mean) may combine it across ranks before the single host transfer, so every
        rank sees the same values and takes the same decisions. With ``engine`` the engine's own
        norm pass is taken over (see :class:`EngineClip`)."""
        self.layers.sync()  # parameters unfrozen or added to the optimizer since the last step
        grads, owners = self.grads()
        # the tensors a clip scales: each gradient once (a flat parameter's whole local gradient)
        self.last_grads = [p.grad for p in self.layers.unique_params() if p.grad is not None] \
            if self.layers.sliced else grads
        n_layers = len(self.layers)
        extra_list = list(extras)
        n_extra = len(extra_list)
        self._engine_total, self._engine = None, None
        weights = None
        if self.sharding is not None and grads:  # local pieces; weights make the mean reduction sum them
            grads, weights = self.sharding.localize(grads)
            engine = None  # the engine's own clip is not taken over under sharding
        plan = self._plan(grads, owners) if grads else None
        device = plan.device if plan is not None else torch.device("cpu")
        dtype = plan.dtype if plan is not None else torch.float32
        if self.watch:
            extra_list.append(None)  # the watched norm's slot (filled below when measurable)
        size = n_layers + len(extra_list) + (2 if engine is not None else 0)
        buf = self._buffer(device, dtype, size)
        engine_vals = None
        if plan is not None:
            stacks: list[torch.Tensor] | None = [] if engine is not None else None
            try:
                per_tensor = fused_layer_sq_norms(grads, plan.groups, plan.index, buf[:n_layers],
                                                  native=engine is not None, foreach=plan.foreach, weights=weights,
                                                  stacks=stacks)
            except RuntimeError:  # a gradient changed dtype or device under a cached plan
                self._plans.clear()
                plan = self._plan(grads, owners)
                stacks = [] if engine is not None else None
                per_tensor = fused_layer_sq_norms(grads, plan.groups, plan.index, buf[:n_layers],
                                                  native=engine is not None, weights=weights, stacks=stacks)
            if engine is not None:
                engine_vals = self._engine_total_of(engine, grads, per_tensor, stacks or [])
            if self.watch:
                extra_list[-1] = self._watched_sq(grads, per_tensor, weights)
        else:
            buf[:n_layers].zero_()
        self._pack_tail(buf, n_layers, extra_list, engine, engine_vals)
        packed = reduce(buf) if reduce is not None else buf
        host = self._read(packed)  # the one host-device sync of the step
        self.transfers += 1
        return self._unpack(host, n_layers, n_extra, engine_vals is not None)

    def _unpack(self, host: list[float], n_layers: int, n_extra: int, engine: bool) -> Measurement:
        """The host copy of the packed buffer as a :class:`Measurement`."""
        layer_norms = [v ** 0.5 for v in host[:n_layers]]  # inf and nan stay as they are
        total = sum(host[:n_layers]) ** 0.5
        bad = [self.layers.layer_names[i] for i, v in enumerate(layer_norms) if not math.isfinite(v)]
        meas = Measurement(layer_norms=layer_norms, total_norm=total, extras=host[n_layers:n_layers + n_extra],
                           nonfinite_layers=bad)
        tail = n_layers + n_extra
        if self.watch:
            if not math.isnan(host[tail]):
                meas.watched_norm = host[tail] ** 0.5
            tail += 1
        if engine:
            meas.engine_norm, meas.engine_coef = host[tail], host[tail + 1]
        return meas

    def _watched_sq(self, grads: list[torch.Tensor], per_tensor: list[torch.Tensor | None],
                    weights: torch.Tensor | None) -> torch.Tensor | None:
        """The squared joint norm of the watched gradients, from the norms just computed: only in the
        usual step (every gradient present, nothing sharded), None otherwise."""
        if weights is not None or len(grads) != len(self.layers.params) or self._watch_version != self.layers.version:
            return None
        picked = [per_tensor[i] for i in self.watch if i < len(per_tensor)]
        if not picked or any(t is None for t in picked):
            return None
        first = picked[0].device  # type: ignore[union-attr]
        return torch.stack([t.to(first, torch.float32) for t in picked]).square().sum()  # type: ignore[union-attr]

    def _pack_tail(self, buf: torch.Tensor, n_layers: int, extras: list[Any], engine: EngineClip | None,
                   engine_vals: Any) -> None:
        """The extras (loss, scale, flags) and the engine's norm and coefficient after the layers."""
        for i, e in enumerate(extras):
            slot = buf[n_layers + i]
            if isinstance(e, torch.Tensor):
                slot.copy_(e.detach().reshape(()), non_blocking=True)
            else:
                slot.fill_(float("nan") if e is None else float(e))
        if engine is None:
            return
        tail = buf[n_layers + len(extras):]
        if engine_vals is None:
            tail.fill_(float("nan"))
        else:
            tail[0].copy_(engine_vals[0])
            tail[1].copy_(engine_vals[1])
            self._engine_total, self._engine = engine_vals[0], engine

    def _read(self, packed: torch.Tensor) -> list[float]:
        host = self._host
        if packed.device.type != "cuda" or host is None or host.numel() != packed.numel() \
                or host.dtype != packed.dtype:
            return packed.tolist()
        host.copy_(packed, non_blocking=True)
        self._event.record()
        self._event.synchronize()
        return host.tolist()

    @torch.no_grad()
    def replay_clip(self, coef: float | None = None) -> torch.Tensor | None:
        """Scale the gradients of the last measured :class:`EngineClip` exactly as
        ``clip_grad_norm_`` would have (same total norm tensor, same coefficient, same kernels);
        returns that total norm tensor (the engine's log value), or None when the last measurement
        could not take the engine's pass over (then call ``clip_grad_norm_`` itself). With the
        measured ``coef`` at 1.0 the scale pass (a multiplication by exactly 1) is left out."""
        total, engine = self._engine_total, self._engine
        self._engine_total, self._engine = None, None
        if total is None or engine is None:
            return None
        if coef is None or not coef >= 1.0:  # nan scales too, as clip_grad_norm_ does
            torch.nn.utils.clip_grads_with_norm_(engine.params, engine.max_norm, total)
        return total

    @torch.no_grad()
    def param_norms(self) -> list[float]:
        """Per-layer parameter norms (log interval only: one extra sync)."""
        return self._layer_norms_of(self.layers.tensors())

    @torch.no_grad()
    def _layer_norms_of(self, tensors: list[torch.Tensor]) -> list[float]:
        if not tensors:  # nothing trainable yet (everything frozen)
            return [0.0] * len(self.layers)
        weights = None
        if self.sharding is not None:
            tensors, weights = self.sharding.localize(tensors)
        device = tensors[0].device
        groups = _groups(tensors)
        index = torch.tensor([self.layers.layer_index[i] for g in groups for i in g], device=device)
        out = torch.zeros(len(self.layers), device=device, dtype=accumulation_dtype(tensors))
        fused_layer_sq_norms(tensors, groups, index, out, weights=weights)
        if self.sharding is not None:
            out = self.sharding.combine(out)
        self.transfers += 1
        return [v ** 0.5 for v in out.tolist()]

    @torch.no_grad()
    def update_ratios(self, before: list[torch.Tensor]) -> tuple[list[float], list[float]]:
        """Per-layer ||update|| / ||weight|| given copies of the parameters taken before the step."""
        now = self.layers.tensors()
        # one fused kernel; tensor by tensor when DTensor and plain parameters mix (tensor parallelism)
        mixed = len({type(t) for t in now}) > 1
        deltas = [a - b for a, b in zip(now, before)] if mixed else torch._foreach_sub(now, before)
        upd = self._layer_norms_of(deltas)
        wn = self._layer_norms_of(now)
        return [u / w if w > 0 else 0.0 for u, w in zip(upd, wn)], wn
