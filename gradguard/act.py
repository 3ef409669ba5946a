"""Actuators: the only code that changes training.

Each actuator owns one knob (clip threshold, LR multipliers, Adam hyperparameters, ...), keeps
its own state and has ``state_dict()/load_state_dict()``. The policy decides, actuators act.
"""

from __future__ import annotations

import math
from collections import deque
from typing import Any

import torch

from ._shard import local_pieces
from .config import AdamConfig, ClipConfig, LRConfig
from .errors import AttachError, UnsupportedSetupError  # AttachError: re-exported here too
from .measure import LayerMap

__all__ = ["AttachError", "unwrap_optimizer", "early_step_gain", "drop_grads", "ClipController", "LRMultiplier", "AdamTuner"]

#: A schedule at this fraction of the LR that failed or above still runs at that LR (a glitch that
#: decays a little inside it): a cut lifts only after a one-step fall from there (see
#: :meth:`LRMultiplier.follow_schedule`).
NEAR_FAILED = 0.5

def _finite_positive(v: Any) -> bool:
    """A real number (not a bool), finite and > 0."""
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v > 0


#: Attribute set on an optimizer while a guard's LR hooks are attached to it.
_OWNER_ATTR = "_gradguard_lr_owner"


def unwrap_optimizer(optimizer: Any) -> torch.optim.Optimizer:
    """The torch optimizer under engine wrappers (accelerate's AcceleratedOptimizer, Lightning's
    LightningOptimizer...)."""
    opt = optimizer
    for _ in range(8):  # wrappers may themselves subclass Optimizer (accelerate's AcceleratedOptimizer)
        inner = getattr(opt, "optimizer", None) or getattr(opt, "_optimizer", None)
        if inner is None or inner is opt or not (isinstance(inner, torch.optim.Optimizer) or hasattr(inner, "optimizer")):
            break
        opt = inner
    if not isinstance(opt, torch.optim.Optimizer):
        raise UnsupportedSetupError(f"gradguard: optimizer={type(optimizer).__name__} is not a torch.optim.Optimizer "
                        "(nor wraps one). Fix: pass the torch optimizer the training loop steps")
    return opt


def early_step_gain(optimizer: torch.optim.Optimizer) -> float:
    """How much larger the optimizer's steps are now than its LR makes them once its statistics
    have settled: 1 for Adam(W) (bias-corrected), SGD and most others. RMSprop divides by a running
    mean of squared gradients that starts at zero and is not bias-corrected: after ``t`` updates its
    steps are ``1 / sqrt(1 - alpha**t)`` times their settled size (3.4x after 9 updates at
    alpha 0.99). A blow-up in its first steps then failed at a larger step than the LR says, and the
    level read as failed (``GuardCore._ramp_position``) is raised by this much. Read once per
    instability (the step count is one small host read), never per step."""
    if not isinstance(optimizer, torch.optim.RMSprop):
        return 1.0
    gain = 1.0
    for group in optimizer.param_groups:
        alpha = group.get("alpha")
        state = next((optimizer.state[p] for p in group["params"] if optimizer.state.get(p)), None)
        if not isinstance(alpha, float) or not 0 < alpha < 1 or not state or "step" not in state:
            continue
        t = float(state["step"])
        if t >= 1:
            gain = max(gain, 1.0 / math.sqrt(1.0 - alpha**t))
    return gain


@torch.no_grad()
def drop_grads(params: list[torch.nn.Parameter]) -> None:
    """Make the coming optimizer step a no-op for these parameters: torch optimizers skip
    parameters whose ``.grad`` is None, so no value reaches weights or state and Adam's step
    count does not advance."""
    for p in params:
        p.grad = None


class ClipController:
    """max_grad_norm owned by gradguard: fixed, tightened/relaxed by the policy, or adaptive (ZClip)."""

    def __init__(self, cfg: ClipConfig) -> None:
        self.cfg = cfg
        self.max_norm = cfg.max_norm
        self.healthy = 0
        # adaptive (ZClip) state
        self.mean: float | None = None
        self.var = 0.0
        self.count = 0
        self.clipped = 0
        self.temp_norm: float | None = None
        self.temp_left = 0

    def hold(self, max_norm: float, steps: int) -> None:
        """Clip at most at ``max_norm`` for the next ``steps`` steps (e.g. after the batch grows)."""
        self.temp_norm, self.temp_left = max_norm, steps

    def threshold(self, total_norm: float) -> float | None:
        """The norm this step is clipped to, or None for no clipping."""
        if self.cfg.mode == "off":
            return None
        if self.temp_left > 0 and self.temp_norm is not None:
            self.temp_left -= 1
            return min(self.temp_norm, self._threshold(total_norm))
        return self._threshold(total_norm)

    def _threshold(self, total_norm: float) -> float:
        if self.cfg.mode == "fixed":
            return self.max_norm
        # adaptive: z-score over an EMA of the norm; the fixed max_norm stays a hard ceiling
        if self.mean is None or self.count < self.cfg.adaptive_warmup:
            return self.max_norm
        std = math.sqrt(max(self.var, 0.0))
        z = (total_norm - self.mean) / (std + 1e-12)
        if z > self.cfg.adaptive_z:
            return min(self.max_norm, self.mean + self.cfg.adaptive_z * std)
        return self.max_norm

    def observe(self, total_norm: float, clipped_to: float | None) -> None:
        """Feed the (pre-clip) norm into the adaptive statistics; spikes enter clipped."""
        if not math.isfinite(total_norm) or self.cfg.mode != "adaptive":
            return
        x = total_norm if clipped_to is None else min(total_norm, clipped_to)
        self.count += 1
        if self.mean is None:
            self.mean, self.var = x, 0.0
            return
        a = 1 - self.cfg.adaptive_alpha
        if self.count <= self.cfg.adaptive_warmup:
            a = max(a, 1.0 / self.count)
        diff = x - self.mean
        self.mean += a * diff
        self.var = (1 - a) * (self.var + a * diff * diff)

    @torch.no_grad()
    def apply(self, grads: list[torch.Tensor], total_norm: float, max_norm: float | None) -> bool:
        """Scale gradients in place so their norm is at most max_norm. Returns True if clipped."""
        if max_norm is None or not math.isfinite(total_norm) or total_norm <= max_norm or not grads:
            return False
        coef = max_norm / (total_norm + 1e-6)
        # sharded gradients scaled through their local pieces (tensor parallelism mixes DTensor and
        # plain gradients, which one fused kernel refuses)
        torch._foreach_mul_(local_pieces(grads), coef)
        self.clipped += 1
        return True

    def tighten(self) -> tuple[float, float]:
        old = self.max_norm
        self.max_norm = max(self.cfg.floor, self.max_norm * self.cfg.tighten_factor)
        self.healthy = 0
        return old, self.max_norm

    def tick_healthy(self) -> tuple[float, float] | None:
        """One healthy step; returns (old, new) when max_norm relaxes."""
        if self.max_norm >= self.cfg.max_norm:
            return None
        self.healthy += 1
        if self.healthy < self.cfg.relax_after:
            return None
        self.healthy = 0
        old = self.max_norm
        self.max_norm = min(self.cfg.max_norm, self.max_norm / self.cfg.tighten_factor)
        return old, self.max_norm

    def reset_healthy(self) -> None:
        self.healthy = 0

    def state_dict(self) -> dict[str, Any]:
        return {"max_norm": self.max_norm, "healthy": self.healthy, "mean": self.mean, "var": self.var,
                "count": self.count, "clipped": self.clipped, "temp_norm": self.temp_norm,
                "temp_left": self.temp_left}

    _STATE = {"max_norm": float, "healthy": int, "mean": (float, type(None)), "var": float, "count": int,
              "clipped": int, "temp_norm": (float, type(None)), "temp_left": int}

    @classmethod
    def check_state(cls, state: Any) -> None:
        """Raise ``StateError`` unless ``state`` is a complete, well-typed clip state."""
        from .state import StateError, check_fields

        check_fields("clip", state, cls._STATE)
        if not (math.isfinite(state["max_norm"]) and state["max_norm"] > 0):
            raise StateError(f"gradguard state clip.max_norm={state['max_norm']!r}: must be finite and > 0. "
                             "Fix: load a state saved by gradguard's state_dict()")

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.check_state(state)
        for k in self._STATE:
            setattr(self, k, state[k])


class LRMultiplier:
    """An LR multiplier applied around every optimizer step, whatever scheduler sets ``lr``.

    A step pre-hook multiplies each group's ``lr`` and a post-hook puts the scheduler's value back,
    so LambdaLR/OneCycleLR/CyclicLR/SequentialLR/ReduceLROnPlateau all keep their own course and
    the multiplier is never baked into them. Layer multipliers scale the update of the targeted
    layers only (exact for any optimizer whose update is proportional to lr, e.g. SGD, Adam(W)):
    those parameters are copied before the step and blended after it.
    """

    def __init__(self, cfg: LRConfig, optimizer: torch.optim.Optimizer, layers: LayerMap, *,
                 hooks: bool = True) -> None:
        """``hooks=False`` (a monitoring guard, which never changes the LR) leaves the optimizer
        untouched, so a monitor may watch an optimizer an acting guard drives."""
        self.cfg = cfg
        self.optimizer = optimizer
        self.layers = layers
        self.global_mult = 1.0
        self.global_ceiling = 1.0
        self.layer_mult: dict[str, float] = {}
        self.layer_ceiling: dict[str, float] = {}
        self.healthy = 0
        self.ceiling_healthy = 0
        self.warm_left = 0
        self.batch_scale = 1.0  # linear-scaling factor while the global batch is shrunk
        # the scheduled LR (first group) of the last glitch_window steps; the cut that lifts if the
        # schedule falls below it in time: {"failed_lr": the highest scheduled LR among the steps
        # that failed, "mult": the multiplier before the cut}; and a lifted cut, which comes back if
        # the schedule climbs above it again: {"failed_lr", "cut": the multiplier lifted, "ceiling"}
        # (see LRConfig.glitch_window)
        self.recent_lrs: deque[float] = deque(maxlen=max(1, cfg.glitch_window))
        self.liftable: dict[str, float] | None = None
        self.lifted: dict[str, float] | None = None
        self._active = False
        self._saved_lrs: list[Any] | None = None
        self._saved_params: tuple[list[torch.Tensor], list[torch.Tensor], list[float]] | None = None
        self._handles: list[Any] = []
        if not hooks:
            return
        owner = getattr(optimizer, _OWNER_ATTR, None)
        if owner is not None and owner is not self and owner.attached:
            raise AttachError(
                f"gradguard: optimizer={type(optimizer).__name__} (id {id(optimizer):#x}) already has an acting "
                "guard attached; a second one would stack its LR multiplier on the first. "
                "Fix: call close() on the first guard (or keep using it) before attaching a new one; "
                "a second guard that only watches must use the 'monitor' preset")
        self._handles = [
            optimizer.register_step_pre_hook(self._pre_hook),
            optimizer.register_step_post_hook(self._post_hook),
        ]
        setattr(optimizer, _OWNER_ATTR, self)

    @property
    def attached(self) -> bool:
        """True while the LR hooks are on the optimizer."""
        return bool(self._handles)

    def remove(self) -> None:
        """Take the hooks off the optimizer and put back any LR a step in progress changed, so the
        optimizer is exactly as the user built it (idempotent)."""
        self.suspend()
        for h in self._handles:
            h.remove()
        self._handles = []
        if getattr(self.optimizer, _OWNER_ATTR, None) is self:
            delattr(self.optimizer, _OWNER_ATTR)

    # -- hooks -----------------------------------------------------------------------------
    def current(self) -> float:
        """The global multiplier in force for the next step (re-warm-up ramp included)."""
        return self.level() * self.batch_scale

    def level(self) -> float:
        """The policy's multiplier in force (re-warm-up ramp included, batch scaling excluded)."""
        if self.warm_left > 0:
            total = self.cfg.rewarm_steps
            return self.global_mult * (total - self.warm_left + 1) / (total + 1)
        return self.global_mult

    def rewarm(self) -> None:
        """Ramp the LR up again from a small fraction over ``rewarm_steps`` (after a rollback)."""
        self.warm_left = self.cfg.rewarm_steps

    def _pre_hook(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        # a step whose gradients were all dropped (a skip) changes nothing and does not count
        self._active = any(p.grad is not None for g in optimizer.param_groups for p in g["params"])
        if not self._active:
            return
        self._multiply_lrs(optimizer)
        active = {k: m for k, m in self.layer_mult.items() if m != 1.0}
        if active:
            params, copies, weights = [], [], []
            layers = self.layers
            for name, m in active.items():
                for i in layers.entries_of([name]):
                    if layers.params[i].grad is not None:
                        p = layers.params[i]
                        if layers.views[i] is not None:
                            (p,) = layers.tensors([i])  # an FSDP1 flat parameter's slice for this layer
                        params.append(p)
                        copies.append(p.detach().clone())
                        weights.append(1.0 - m)
            self._saved_params = (params, copies, weights)

    @torch.no_grad()
    def _post_hook(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        if not self._active:
            return
        self._restore_lrs(optimizer)
        if self._saved_params is not None:
            params, copies, weights = self._saved_params
            for p, c, w in zip(params, copies, weights):
                p.lerp_(c, w)  # p_new + (1-m)(p_old - p_new) = p_old + m * update
            self._saved_params = None

    def engine_begin(self) -> None:
        """Before the optimizer step of an engine that steps it itself (without the hooks): the
        multiplier goes on every group's ``lr`` (layer multipliers do not apply: such an engine's
        optimizer updates flat copies of the parameters)."""
        self._saved_lrs = None
        self._multiply_lrs(self.optimizer)
        self._active = True

    def engine_end(self) -> None:
        """After that step: the scheduler's values back, one step of a re-warm-up ramp counted."""
        if self._active:
            self._active = False
            self._restore_lrs(self.optimizer)

    def _multiply_lrs(self, optimizer: torch.optim.Optimizer) -> None:
        """Every group's ``lr`` times the multiplier in force for this step (the scheduler's values kept)."""
        mult = self.current()
        if mult != 1.0:
            self._saved_lrs = [g["lr"] for g in optimizer.param_groups]
            for g in optimizer.param_groups:
                g["lr"] = g["lr"] * mult

    def _restore_lrs(self, optimizer: torch.optim.Optimizer) -> None:
        """After the step: the scheduler's values back; one step of a re-warm-up ramp counted."""
        if self.warm_left > 0:
            self.warm_left -= 1
        if self._saved_lrs is not None:
            for g, lr in zip(optimizer.param_groups, self._saved_lrs):
                g["lr"] = lr
            self._saved_lrs = None

    def suspend(self) -> None:
        """Undo the pre-hook of a step already in progress (engines that decide inside
        ``optimizer.step()``, e.g. Lightning's closure): the scheduler's LRs are back in place."""
        if self._saved_lrs is not None:
            for g, lr in zip(self.optimizer.param_groups, self._saved_lrs):
                g["lr"] = lr
        self._saved_lrs = None
        self._saved_params = None

    def rearm(self) -> None:
        """Apply the pre-hook again, with the multipliers as decided now (after ``suspend``)."""
        self._pre_hook(self.optimizer, (), {})

    def reapply_after_restore(self) -> None:
        """Drop any half-applied step state after a rollback restored the optimizer."""
        self._saved_lrs = None
        self._saved_params = None

    def scheduled_lrs(self) -> list[float]:
        """The scheduler's LRs, without the multipliers (also while a step is in progress)."""
        if self._saved_lrs is not None:
            return list(self._saved_lrs)
        return [float(g["lr"]) for g in self.optimizer.param_groups]

    # -- policy moves ----------------------------------------------------------------------
    def effective_lrs(self) -> list[float]:
        return [float(g["lr"]) * self.current() for g in self.optimizer.param_groups]

    def lower(self, failed_at: float | None = None, factor: float | None = None) -> tuple[float, float]:
        """Multiply the global multiplier by ``factor`` (default down_factor), starting from the
        multiplier that failed (``failed_at``, default the one in force: during a re-warm-up ramp
        that is the ramp's value). The failed level caps later recovery."""
        old = self.level() if failed_at is None else failed_at
        self.lifted = None  # a new cut supersedes a lifted one
        if self.cfg.glitch_window and self.recent_lrs:
            failed_lr = max(self.recent_lrs)
            if self.liftable is None:
                self.liftable = {"failed_lr": failed_lr, "mult": self.global_mult}
            else:  # a later rung of the same episode: lifting goes back to before the first cut
                self.liftable["failed_lr"] = max(self.liftable["failed_lr"], failed_lr)
        self.global_ceiling = min(self.global_ceiling, old * self.cfg.recover_ceiling)
        self.global_mult = max(self.cfg.min_multiplier, old * (factor or self.cfg.down_factor))
        self.healthy = 0
        return old, self.global_mult

    def observe_schedule(self, lr: Any) -> None:
        """The scheduled LR (first group, multipliers excluded) this step runs at, as the core already
        read it (anything but a finite positive number is ignored)."""
        if _finite_positive(lr):
            self.recent_lrs.append(float(lr))

    def follow_schedule(self) -> tuple[str, dict[str, float]] | None:
        """A cut the schedule has passed lifts: within the last ``glitch_window`` steps the schedule
        fell in one step by ``1/down_factor`` or more from (half or more of) the LR that failed, and
        it now runs below ``down_factor`` x that LR: the scheduler alone runs below what the cut set,
        as when an LR glitch ends or a step schedule drops. The multiplier goes back to its level
        before the cut (the ceiling too, at least). A smooth decay never falls 3.3x in one step but
        at its very end, far below the failed LR, so a cut in it stays; the record is dropped once
        the failed LR has left the window. A lifted cut comes back if the schedule climbs above
        ``down_factor`` x the failed LR again (a cyclic schedule). Returns the action's name and
        params when the multiplier moved, else None."""
        if not self.recent_lrs:
            return None
        now = self.recent_lrs[-1]
        back = self.lifted
        if back is not None:
            if now <= self.cfg.down_factor * back["failed_lr"]:
                return None
            self.lifted = None
            old = self.global_mult
            self.global_mult = min(self.global_mult, back["cut"])
            self.global_ceiling = min(self.global_ceiling, back["ceiling"])
            self.liftable = {"failed_lr": back["failed_lr"], "mult": old}
            self.healthy = 0
            return "recut_lr", {"from": old, "to": self.global_mult, "failed_lr": back["failed_lr"], "scheduled_lr": now}
        cut = self.liftable
        if cut is None:
            return None
        high, d = NEAR_FAILED * cut["failed_lr"], self.cfg.down_factor
        if max(self.recent_lrs) < high:
            self.liftable = None
            return None
        lrs = list(self.recent_lrs)
        fell = any(a >= high and b <= d * a for a, b in zip(lrs, lrs[1:]))
        if now > d * cut["failed_lr"] or not fell:
            return None
        self.liftable = None
        old = self.global_mult
        self.lifted = {"failed_lr": cut["failed_lr"], "cut": old, "ceiling": self.global_ceiling}
        self.global_mult = max(self.global_mult, cut["mult"])
        self.global_ceiling = max(self.global_ceiling, cut["mult"])
        return "lift_lr", {"from": old, "to": self.global_mult, "failed_lr": cut["failed_lr"], "scheduled_lr": now}

    def lower_layers(self, names: list[str]) -> dict[str, float]:
        out = {}
        for n in names:
            old = self.layer_mult.get(n, 1.0)
            self.layer_ceiling[n] = min(self.layer_ceiling.get(n, 1.0), old * self.cfg.recover_ceiling)
            new = max(self.cfg.min_multiplier, old * self.cfg.layer_factor)
            self.layer_mult[n] = new
            out[n] = new
        self.healthy = 0
        return out

    def mark_unstable(self, failed_at: float | None = None) -> None:
        """An instability happened at ``failed_at`` (default: the multiplier in force): recovery
        stays below it."""
        level = self.level() if failed_at is None else failed_at
        self.global_ceiling = min(self.global_ceiling, level * self.cfg.recover_ceiling)
        self.healthy = 0
        self.ceiling_healthy = 0

    def tick_healthy(self) -> dict[str, float] | None:
        """One healthy step; every recover_after of them, lowered multipliers move towards their
        ceiling, and every 4 x recover_after the ceilings themselves rise towards 1 (a fault that
        has passed, such as an LR glitch, does not cap the LR forever). Returns the new
        multipliers when something moved."""
        if self.global_ceiling < 1.0 or any(c < 1.0 for c in self.layer_ceiling.values()):
            self.ceiling_healthy += 1
            if self.ceiling_healthy >= 4 * self.cfg.recover_after:
                self.ceiling_healthy = 0
                f = self.cfg.recover_factor
                self.global_ceiling = min(1.0, self.global_ceiling * f)
                self.layer_ceiling = {k: min(1.0, c * f) for k, c in self.layer_ceiling.items()}
        lowered = self.global_mult < self.global_ceiling or any(
            m < self.layer_ceiling.get(k, 1.0) for k, m in self.layer_mult.items())
        if not lowered:
            return None
        self.healthy += 1
        if self.healthy < self.cfg.recover_after:
            return None
        self.healthy = 0
        f = self.cfg.recover_factor
        self.global_mult = min(self.global_ceiling, self.global_mult * f)
        for k, m in list(self.layer_mult.items()):
            self.layer_mult[k] = min(self.layer_ceiling.get(k, 1.0), m * f)
        return {"global": self.global_mult, **self.layer_mult}

    def state_dict(self) -> dict[str, Any]:
        return {"global_mult": self.global_mult, "global_ceiling": self.global_ceiling,
                "layer_mult": dict(self.layer_mult), "layer_ceiling": dict(self.layer_ceiling),
                "healthy": self.healthy, "ceiling_healthy": self.ceiling_healthy, "warm_left": self.warm_left,
                "batch_scale": self.batch_scale, "recent_lrs": list(self.recent_lrs),
                "liftable": None if self.liftable is None else dict(self.liftable),
                "lifted": None if self.lifted is None else dict(self.lifted)}

    _STATE = {"global_mult": float, "global_ceiling": float, "layer_mult": dict, "layer_ceiling": dict,
              "healthy": int, "ceiling_healthy": int, "warm_left": int, "batch_scale": float}

    @classmethod
    def check_state(cls, state: Any) -> None:
        """Raise ``StateError`` unless ``state`` is a complete, well-typed LR-multiplier state."""
        from .state import StateError, check_fields

        check_fields("lr", state, cls._STATE, optional={"recent_lrs": list})  # absent in states before 0.2
        for lr in state.get("recent_lrs", []):
            if not _finite_positive(lr):
                raise StateError(f"gradguard state lr.recent_lrs holds {lr!r}: each must be finite and > 0. "
                                 "Fix: load a state saved by gradguard's state_dict()")
        for key, keys in (("liftable", {"failed_lr", "mult"}), ("lifted", {"failed_lr", "cut", "ceiling"})):
            rec = state.get(key)
            if rec is not None and (not isinstance(rec, dict) or set(rec) != keys
                                    or not all(map(_finite_positive, rec.values()))):
                raise StateError(f"gradguard state lr.{key}={rec!r}: must be None or a dict of finite, positive "
                                 f"{sorted(keys)}. Fix: load a state saved by gradguard's state_dict()")
        for key in ("global_mult", "global_ceiling", "batch_scale"):
            if not (math.isfinite(state[key]) and state[key] > 0):
                raise StateError(f"gradguard state lr.{key}={state[key]!r}: must be finite and > 0. "
                                 "Fix: load a state saved by gradguard's state_dict()")
        for key in ("layer_mult", "layer_ceiling"):
            for name, v in state[key].items():
                if not _finite_positive(v):
                    raise StateError(f"gradguard state lr.{key}[{name!r}]={v!r}: must be finite and > 0. "
                                     "Fix: load a state saved by gradguard's state_dict()")

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.check_state(state)
        self.ceiling_healthy = state["ceiling_healthy"]
        self.warm_left = state["warm_left"]
        self.batch_scale = state["batch_scale"]
        self.global_mult = state["global_mult"]
        self.global_ceiling = state["global_ceiling"]
        self.layer_mult = dict(state["layer_mult"])
        self.layer_ceiling = dict(state["layer_ceiling"])
        self.healthy = state["healthy"]
        self.recent_lrs = deque((float(v) for v in state.get("recent_lrs", [])), maxlen=max(1, self.cfg.glitch_window))
        cut, back = state.get("liftable"), state.get("lifted")
        self.liftable = None if cut is None else {k: float(v) for k, v in cut.items()}
        self.lifted = None if back is None else {k: float(v) for k, v in back.items()}


class AdamTuner:
    """Changes Adam's beta2/eps live in every param group that has them (Adam state is kept)."""

    def __init__(self, cfg: AdamConfig, optimizer: torch.optim.Optimizer) -> None:
        self.cfg = cfg
        self.optimizer = optimizer
        self.applied = False

    def supported(self) -> bool:
        return any("betas" in g and "eps" in g for g in self.optimizer.param_groups)

    def apply(self) -> dict[str, Any]:
        changes = {}
        for i, g in enumerate(self.optimizer.param_groups):
            if "betas" not in g:
                continue
            b1, b2 = g["betas"]
            new_b2 = min(float(b2), self.cfg.beta2)
            new_eps = max(float(g.get("eps", 0.0)), self.cfg.eps)
            if new_b2 != b2 or new_eps != g.get("eps"):
                changes[f"group{i}"] = {"beta2": [float(b2), new_b2], "eps": [float(g.get("eps", 0.0)), new_eps]}
            g["betas"] = (b1, new_b2)
            if "eps" in g:
                g["eps"] = new_eps
        self.applied = True
        return changes

    def state_dict(self) -> dict[str, Any]:
        return {"applied": self.applied}

    @classmethod
    def check_state(cls, state: Any) -> None:
        """Raise ``StateError`` unless ``state`` is a well-typed Adam-tuner state."""
        from .state import check_fields

        check_fields("adam", state, {"applied": bool})

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.check_state(state)
        self.applied = state["applied"]
