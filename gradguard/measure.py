"""Per-layer gradient norms in one fused pass and one host-device sync per step."""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import torch
from torch import nn

from .errors import UnsupportedSetupError

__all__ = ["default_layer_name", "LayerMap", "Measurement", "GradMeasurer", "metric_key", "norm_layers",
           "is_norm_module"]

_WRAPPER_PREFIXES = ("module.", "_orig_mod.", "_forward_module.", "_fsdp_wrapped_module.")


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
        name = name.replace("._orig_mod.", ".").replace("._fsdp_wrapped_module.", ".")
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
                 optimizer: torch.optim.Optimizer | None = None) -> None:
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
        self._add(p_name_pairs=[(n, p) for n, p in model.named_parameters() if p.requires_grad])
        if not self.params and (optimizer is None or not self._holds_model_params(optimizer)):
            raise UnsupportedSetupError("gradguard: the model has no trainable parameters (requires_grad=True); "
                             "attach the guard to the model being trained")
        if optimizer is not None:
            self._signature = self._opt_signature()
            self._frozen = [p for p in self._untracked_optimizer_params() if not p.requires_grad]

    def _add(self, p_name_pairs: list[tuple[str, nn.Parameter]]) -> list[str]:
        added = []
        for pname, p in p_name_pairs:
            if id(p) in self._ids:
                continue
            layer = self._fn(pname)
            if layer not in self._seen:
                self._seen[layer] = len(self.layer_names)
                self.layer_names.append(layer)
            self._ids.add(id(p))
            self.params.append(p)
            self.param_names.append(pname)
            self.layer_index.append(self._seen[layer])
            added.append(pname)
        return added

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
        self._frozen = [p for p in self._untracked_optimizer_params() if not p.requires_grad]
        if added:
            self.version += 1
        return added

    def __len__(self) -> int:
        return len(self.layer_names)

    def params_of(self, layers: Iterable[str]) -> list[nn.Parameter]:
        wanted = {self.layer_names.index(n) for n in layers if n in self.layer_names}
        return [p for p, i in zip(self.params, self.layer_index) if i in wanted]

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


def norm_layers(model: nn.Module, layers: LayerMap) -> list[str]:
    """The layers of ``layers`` made only of normalization parameters (a final ``ln_f``)."""
    norm_ids = {id(p) for m in model.modules() if is_norm_module(m) for p in m.parameters(recurse=False)}
    owned: dict[int, bool] = {}
    for p, li in zip(layers.params, layers.layer_index):
        owned[li] = owned.get(li, True) and id(p) in norm_ids
    return [layers.layer_names[li] for li, only_norm in sorted(owned.items()) if only_norm]


@dataclass
class Measurement:
    """What one step's sync brought back to the host."""

    layer_norms: list[float]
    total_norm: float
    extras: list[float] = field(default_factory=list)
    nonfinite_layers: list[str] = field(default_factory=list)
    syncs: int = 1


def _fused_norms(grads: list[torch.Tensor]) -> list[torch.Tensor]:
    try:
        return list(torch._foreach_norm(grads, 2, dtype=torch.float32))
    except Exception:  # sparse, mixed devices, old torch: fall back to one norm per tensor
        out = []
        for g in grads:
            if g.is_sparse:
                g = g.coalesce()._values()
            out.append(torch.linalg.vector_norm(g, 2, dtype=torch.float32))
        return out


class GradMeasurer:
    """Per-layer L2 norms of the current gradients (plus any extra scalars) in one transfer."""

    def __init__(self, layers: LayerMap) -> None:
        self.layers = layers
        self._index_cache: dict[tuple[torch.device, tuple[int, ...]], torch.Tensor] = {}
        self.transfers = 0  # host-device transfers made by measure(): one per call

    def grads(self) -> tuple[list[torch.Tensor], list[int]]:
        grads, owners = [], []
        for p, li in zip(self.layers.params, self.layers.layer_index):
            if p.grad is not None:
                grads.append(p.grad)
                owners.append(li)
        return grads, owners

    def measure(self, extras: Iterable[torch.Tensor | float | None] = (),
                reduce: Callable[[torch.Tensor], torch.Tensor] | None = None) -> Measurement:
        """Squared per-layer norms and the extras are packed into one tensor; ``reduce`` (e.g. a
        DDP all-reduce mean) may combine it across ranks before the single host transfer, so every
        rank sees the same values and takes the same decisions."""
        self.layers.sync()  # parameters unfrozen or added to the optimizer since the last step
        grads, owners = self.grads()
        n_layers = len(self.layers)
        if grads:
            device = grads[0].device
            norms = [n if n.device == device else n.to(device, non_blocking=True)
                     for n in _fused_norms(grads)]
            key = (device, tuple(owners))
            index = self._index_cache.get(key)
            if index is None:
                if len(self._index_cache) > 8:
                    self._index_cache.clear()
                index = torch.tensor(owners, device=device, dtype=torch.long)
                self._index_cache[key] = index
            sq = torch.stack(norms).square()
            layer_sq = torch.zeros(n_layers, device=device, dtype=torch.float32).index_add_(0, index, sq)
        else:
            device = torch.device("cpu")
            layer_sq = torch.zeros(n_layers)
        extra_list = [e for e in extras]
        values = [layer_sq]
        if extra_list:
            values.append(torch.stack([
                (e.detach().reshape(()).to(device=device, dtype=torch.float32)
                 if isinstance(e, torch.Tensor)
                 else torch.tensor(float("nan") if e is None else float(e), device=device))
                for e in extra_list
            ]))
        packed = torch.cat(values)
        if reduce is not None:
            packed = reduce(packed)
        host = packed.tolist()  # the one host-device sync of the step
        self.transfers += 1
        layer_sq_h = host[:n_layers]
        layer_norms = [v ** 0.5 for v in layer_sq_h]  # inf and nan stay as they are
        total = sum(layer_sq_h) ** 0.5
        bad = [self.layers.layer_names[i] for i, v in enumerate(layer_norms) if not math.isfinite(v)]
        return Measurement(layer_norms=layer_norms, total_norm=total, extras=host[n_layers:],
                           nonfinite_layers=bad)

    @torch.no_grad()
    def param_norms(self) -> list[float]:
        """Per-layer parameter norms (log interval only: one extra sync)."""
        return self._layer_norms_of(list(self.layers.params))

    @torch.no_grad()
    def _layer_norms_of(self, tensors: list[torch.Tensor]) -> list[float]:
        if not tensors:  # nothing trainable yet (everything frozen)
            return [0.0] * len(self.layers)
        device = tensors[0].device
        norms = [n.to(device) for n in _fused_norms(tensors)]
        index = torch.tensor(self.layers.layer_index, device=device)
        layer_sq = torch.zeros(len(self.layers), device=device).index_add_(0, index, torch.stack(norms).square())
        self.transfers += 1
        return [v ** 0.5 for v in layer_sq.tolist()]

    @torch.no_grad()
    def update_ratios(self, before: list[torch.Tensor]) -> tuple[list[float], list[float]]:
        """Per-layer ||update|| / ||weight|| given copies of the parameters taken before the step."""
        params = list(self.layers.params)
        deltas = torch._foreach_sub([p.detach() for p in params], before)
        upd = self._layer_norms_of(deltas)
        wn = self._layer_norms_of([p.detach() for p in params])
        return [u / w if w > 0 else 0.0 for u, w in zip(upd, wn)], wn
