"""Detectors: read one step's signals, return findings. They never change training."""

from __future__ import annotations

import math
import re
import statistics
from collections import deque
from dataclasses import asdict, dataclass, field
from typing import Any

from .config import DetectConfig

__all__ = ["Signals", "Finding", "RobustBaseline", "NonFiniteDetector", "LossSpikeDetector",
           "GradSpikeDetector", "LossScaleDetector", "NormTakeoverDetector", "Detectors", "INFO", "WARNING", "CRITICAL",
           "NORM_TAKEOVER", "body_layers"]

INFO, WARNING, CRITICAL = "info", "warning", "critical"
#: During warm-up the loss detector's noise term uses this fraction of ``loss_sigma``.
EARLY_SIGMA_FRACTION = 0.5
#: During warm-up the loss detector's reference is the highest of this many last healthy losses.
RECENT = 3
#: Finding kind of the quiet-degradation detector (:class:`NormTakeoverDetector`).
NORM_TAKEOVER = "norm_takeover"
_NUMBERED = re.compile(r"(^|\.)\d+(\.|$)")


def body_layers(layer_names: list[str]) -> list[str]:
    """The model's body: layers inside a numbered container (``transformer.h.3``, ``model.layers.0``,
    ``blocks.2``, ``layer1.0``), i.e. the repeated blocks between the input and output layers."""
    return [n for n in layer_names if _NUMBERED.search(n)]


@dataclass
class Signals:
    """One optimizer step as the detectors see it (host floats only)."""

    step: int
    loss: float | None
    total_norm: float
    layer_norms: dict[str, float]
    nonfinite_layers: list[str] = field(default_factory=list)
    scale: float | None = None
    overflow: bool = False
    lrs: list[float] = field(default_factory=list)
    inner_norm: float | None = None
    """The joint gradient norm of the normalization parameters inside the blocks, measured only
    for a model without a standalone final norm (post-LN); None otherwise."""


@dataclass
class Finding:
    """Something a detector saw: kind, severity, the value against its threshold, culprit layers."""

    kind: str
    severity: str
    step: int
    value: float | None = None
    threshold: float | None = None
    baseline: float | None = None
    layers: list[str] = field(default_factory=list)
    message: str = ""
    moved_layers: list[str] = field(default_factory=list)
    """For a loss spike: the layers whose grad norm moved most against their own baseline (the
    likely culprits; reported only, they do not steer the per-layer LR rung)."""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


class RobustBaseline:
    """EMA of a series (the baseline) and a robust spread from its step-to-step changes:
    sigma ~ 1.25 * EMA(|x_t - x_{t-1}|) / sqrt(2), which a downward training trend does not inflate.

    Spikes enter clipped to the threshold and move only the mean, so one outlier neither hides
    the next one nor widens the threshold, and a genuine level shift is still absorbed slowly.
    """

    def __init__(self, alpha: float, min_rel_spread: float) -> None:
        self.alpha = alpha
        self.min_rel_spread = min_rel_spread
        self.mean: float | None = None
        self.dev = 0.0
        self.prev: float | None = None
        self.count = 0

    def sigma(self) -> float:
        assert self.mean is not None
        return max(1.2533 * self.dev, self.min_rel_spread * abs(self.mean), 1e-12)

    def threshold(self, n_sigma: float, ratio: float) -> float:
        assert self.mean is not None
        return max(self.mean + n_sigma * self.sigma(), ratio * self.mean)

    def update(self, x: float, spike: bool = False) -> None:
        """Add a value. A spike (passed clipped to its threshold) moves only the mean, so a long
        level shift is absorbed slowly while the spread, and with it the threshold, stays put."""
        if not math.isfinite(x):
            return
        self.count += 1
        if self.mean is None:
            self.mean = self.prev = x
            self.dev = 0.0
            return
        # fast start: a plain average over the first 1/alpha values, then the EMA
        a = max(self.alpha, 1.0 / self.count)
        self.mean += a * (x - self.mean)
        if not spike:
            d = abs(x - (self.prev if self.prev is not None else x)) / math.sqrt(2.0)
            b = max(self.alpha, 1.0 / max(1, self.count - 1))
            self.dev += b * (d - self.dev)
            self.prev = x

    def state_dict(self) -> dict[str, Any]:
        return {"mean": self.mean, "dev": self.dev, "prev": self.prev, "count": self.count}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.mean, self.dev, self.prev, self.count = state["mean"], state["dev"], state["prev"], state["count"]


class NonFiniteDetector:
    """Non-finite loss or gradients, naming the layers whose gradients are non-finite.

    With a GradScaler an inf/nan gradient is an overflow the scaler handles; it is reported as
    an 'overflow' (info), not as a critical non-finite gradient."""

    def observe(self, s: Signals) -> list[Finding]:
        out = []
        if s.loss is not None and not math.isfinite(s.loss):
            out.append(Finding("nonfinite_loss", CRITICAL, s.step, value=s.loss,
                               layers=list(s.nonfinite_layers),
                               message=f"loss is {s.loss}"))
        if s.nonfinite_layers:
            if s.overflow:
                out.append(Finding("overflow", INFO, s.step, value=s.scale, layers=list(s.nonfinite_layers),
                                   message=f"fp16 overflow at scale {s.scale}"))
            else:
                out.append(Finding("nonfinite_grad", CRITICAL, s.step, layers=list(s.nonfinite_layers),
                                   message="non-finite gradients in " + ", ".join(s.nonfinite_layers[:5])))
        return out

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass


class LossSpikeDetector:
    """Loss far above its robust baseline. During warm-up (before the baseline has
    ``warmup_steps`` healthy values) a loss is a spike when it is above ``early_loss_ratio`` x the
    lower of the last healthy loss and the healthy mean, *and* above the healthy mean by
    ``loss_sigma`` robust standard deviations: the ratio catches a blow-up in the first steps of a
    smooth run, the sigma term keeps a noisy run (small batches, heavy-tailed losses) from being
    flagged. A third warm-up spike in a row joins the baseline (the reference was a lucky low
    loss; a real blow-up has been acted on by then) and warm-up ends after ``3 x warmup_steps``
    observed steps, so a noisy run is never stuck in warm-up.

    No finding comes from a single comparison: while the baseline holds one value there is no
    spread to judge a jump against (two losses of a random-data run, or of a small-batch
    regression, differ by 1.5x or more about half the time), so a loss above the threshold is
    *held* and judged with the next one. If that one is above the same threshold too and has not
    fallen below the held loss / ``early_loss_ratio``, the loss stayed up: a finding (a real
    blow-up, as with a far too high LR, keeps its level or rises); if not, the held loss was noise
    and both join the baseline. The reference is the highest of the last :data:`RECENT` healthy
    losses (not the lowest): a falling loss keeps it near the current level, and a noisy run's own
    recent highs set its bar."""

    def __init__(self, cfg: DetectConfig) -> None:
        self.cfg = cfg
        self.base = RobustBaseline(cfg.ema_alpha, cfg.min_rel_spread)
        self.healthy = 0
        self.seen = 0
        self.early_flags = 0  # consecutive warm-up spikes
        self.min_loss: float | None = None  # lowest healthy loss (reported in the diagnosis)
        self.first: float | None = None  # the run's first finite loss (the progress reference)
        self.held: float | None = None  # a jump over the only earlier loss, judged with the next one
        self.streak: list[float] = []  # the losses of the current run of warm-up flags
        self.recent: list[float] = []  # the last RECENT healthy losses (the warm-up reference)
        #: this step's lesson (values for the baseline), applied by :meth:`commit` only
        self._pending: list[tuple[float, bool]] = []
        self._pending_recent = True

    def commit(self) -> None:
        """The step taught (see ``gradguard.core.teaches``): its losses join the baseline."""
        for v, spike in self._pending:
            self.base.update(v, spike=spike)
            if spike:
                continue
            self.healthy += 1
            self.min_loss = v if self.min_loss is None else min(self.min_loss, v)
            if self._pending_recent:  # a run of flags keeps the reference: it stays up, it is flagged again
                self.recent = [*self.recent, v][-RECENT:]
        self.discard()

    def discard(self) -> None:
        """The step teaches nothing: its staged lesson is dropped."""
        self._pending, self._pending_recent = [], True

    def restart(self) -> None:
        """After a rollback: the judgement in progress (a held jump, a run of warm-up flags) starts over."""
        self.held, self.streak, self.early_flags = None, [], 0
        self.discard()

    def progressed(self, fraction: float = 0.1) -> bool:
        """The run has learned something: its lowest healthy loss is at least ``fraction`` below
        its first loss. A blow-up in a run that never progressed says the LR is grossly too high;
        one after progress (a warm-up ramp overshooting) calls for an ordinary cut."""
        return (self.first is not None and self.min_loss is not None and self.first > 0
                and self.min_loss < (1 - fraction) * self.first)

    def _armed(self) -> bool:
        cfg = self.cfg
        return self.base.mean is not None and (self.healthy >= cfg.warmup_steps or self.seen >= 3 * cfg.warmup_steps)

    def observe(self, s: Signals) -> list[Finding]:
        self.commit()  # used on its own (no core settling each step), every observed step teaches
        x = s.loss
        if x is None or not math.isfinite(x) or s.overflow:
            return []  # an fp16 overflow step's loss is the scaler's business (the scale detectors)
        if self.first is None:
            self.first = x
        cfg = self.cfg
        self.seen += 1
        finding = None
        base = self.base
        if self._armed():
            thr = base.threshold(cfg.loss_sigma, cfg.loss_ratio)
            if x > thr:
                sev = CRITICAL if x > 2 * thr else WARNING
                finding = Finding("loss_spike", sev, s.step, value=x, threshold=thr, baseline=base.mean,
                                  message=f"loss {x:.4g} > {thr:.4g} (baseline {base.mean:.4g})")
                self._pending = [(thr, True)]  # clipped to the threshold: moves the mean only
        elif base.mean is not None and base.prev is not None:
            # the reference is the highest of the last few healthy losses: a falling loss keeps it
            # close to the current level, a noisy one (small batches, heavy-tailed losses) keeps its
            # own recent highs in it, so sampling noise is not read as a jump over a lucky low value
            ref = max(self.recent) if self.recent else min(base.prev, base.mean)
            # few values, often from a falling loss: half the sigma multiplier of the armed rule
            noise = base.mean + EARLY_SIGMA_FRACTION * cfg.loss_sigma * base.sigma() if base.count >= 2 else 0.0
            thr = max(cfg.early_loss_ratio * ref, noise)
            if x > thr > 0 and base.count < 2 and self.held is None and self.early_flags == 0:
                # few earlier values: too little spread to judge a jump against; the next loss decides
                self.held = x
                return []
            # the loss stayed up: above the threshold, and not fallen far below the held jump (a
            # noisy run's high value is followed by anything; a blow-up keeps its level or rises)
            stayed = self.held is None or x > self.held / cfg.early_loss_ratio
            if x > thr > 0 and stayed:
                if self.held is not None:  # the loss stayed up: the held one was part of the run
                    self.streak.append(self.held)
                    self.held = None
                self.early_flags += 1
                # a third flag in a row in warm-up: the reference was a lucky low loss of a noisy run
                # (a real blow-up has been acted on by then), so the loss joins the baseline, and so
                # do the losses flagged against that reference before it
                if self.early_flags < 3:
                    self.streak.append(x)
                    finding = Finding("loss_spike", CRITICAL if x > 2 * thr else WARNING, s.step, value=x,
                                      threshold=thr, baseline=ref,
                                      message=f"loss {x:.4g} > {thr:.4g} ({cfg.early_loss_ratio} x recent loss "
                                              f"{ref:.4g}) during warm-up")
        if finding is None:
            # the held jump was noise; a run of flags that reached three was judged against a lucky low
            # reference: these join the baseline first. A run ended by a normal loss was a spike: dropped.
            lucky_low = self.early_flags >= 3
            joining = ([self.held] if self.held is not None else []) + (self.streak if lucky_low else [])
            # (the detector withdrew its verdict on them). They join only if this step teaches.
            self.early_flags, self.held, self.streak = 0, None, []
            self._pending = [(v, False) for v in [*joining, x]]
            self._pending_recent = not lucky_low
            return []
        return [finding]

    def state_dict(self) -> dict[str, Any]:
        return {"base": self.base.state_dict(), "healthy": self.healthy, "min_loss": self.min_loss,
                "seen": self.seen, "early_flags": self.early_flags, "held": self.held, "streak": list(self.streak),
                "recent": list(self.recent), "first": self.first}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.discard()
        self.base.load_state_dict(state["base"])
        self.healthy, self.min_loss = state["healthy"], state["min_loss"]
        self.seen = int(state.get("seen", self.healthy))
        self.early_flags = int(state.get("early_flags", 0))
        held = state.get("held")
        self.held = None if held is None else float(held)
        self.streak = [float(v) for v in state.get("streak", [])]
        self.recent = [float(v) for v in state.get("recent", [])][-RECENT:]
        first = state.get("first")
        self.first = None if first is None else float(first)


class GradSpikeDetector:
    """Total and per-layer grad-norm spikes against robust baselines (armed after warm-up)."""

    def __init__(self, cfg: DetectConfig) -> None:
        self.cfg = cfg
        self.total = RobustBaseline(cfg.ema_alpha, cfg.min_rel_spread)
        self.layers: dict[str, RobustBaseline] = {}
        #: this step's lesson: (baseline, value, spike), applied by :meth:`commit` only
        self._pending: list[tuple[RobustBaseline, float, bool]] = []

    def commit(self) -> None:
        """The step taught: its norms join the total and per-layer baselines."""
        for b, v, spike in self._pending:
            b.update(v, spike=spike)
        self._pending = []

    def discard(self) -> None:
        """The step teaches nothing."""
        self._pending = []

    def moved_most(self, layer_norms: dict[str, float], k: int = 3) -> list[str]:
        """The ``k`` layers whose norm is the most times its own baseline (above 1x), largest first."""
        ratios = []
        for name, v in layer_norms.items():
            b = self.layers.get(name)
            if b is not None and b.mean is not None and b.mean > 0 and math.isfinite(v) and v > b.mean:
                ratios.append((v / b.mean, name))
        return [name for _, name in sorted(ratios, reverse=True)[:k]]

    def restart_total(self) -> None:
        """Start the total-norm baseline over (the set of measured layers changed)."""
        self.total = RobustBaseline(self.cfg.ema_alpha, self.cfg.min_rel_spread)

    def ratio(self, norm: float) -> float:
        """How many times the total-norm baseline this norm is (1.0 before any baseline)."""
        if self.total.mean is None or self.total.count < self.cfg.warmup_steps or self.total.mean <= 0:
            return 1.0
        return norm / self.total.mean

    def observe(self, s: Signals) -> list[Finding]:
        self.commit()  # used on its own (no core settling each step), every observed step teaches
        cfg = self.cfg
        out: list[Finding] = []
        if not math.isfinite(s.total_norm):
            return out
        armed = self.total.count >= cfg.warmup_steps and self.total.mean is not None
        culprits: list[str] = []
        pending = self._pending = []
        for name, v in s.layer_norms.items():
            b = self.layers.get(name)
            if b is None:
                b = self.layers[name] = RobustBaseline(cfg.ema_alpha, cfg.min_rel_spread)
            if armed and b.mean is not None and b.mean > 0:
                thr = b.threshold(cfg.layer_grad_sigma, cfg.layer_grad_ratio)
                if v > thr:
                    culprits.append(name)
                    pending.append((b, thr, True))
                    continue
            pending.append((b, v, False))
        if armed:
            thr = self.total.threshold(cfg.grad_sigma, cfg.grad_ratio)
            if s.total_norm > thr:
                sev = CRITICAL if s.total_norm > 10 * thr else WARNING
                out.append(Finding("grad_spike", sev, s.step, value=s.total_norm, threshold=thr,
                                   baseline=self.total.mean, layers=culprits,
                                   message=f"grad norm {s.total_norm:.4g} > {thr:.4g} "
                                           f"(baseline {self.total.mean:.4g})"))
                pending.append((self.total, thr, True))
                return out
        if culprits:
            out.append(Finding("layer_grad_spike", INFO, s.step, layers=culprits,
                               message="layer grad-norm spike in " + ", ".join(culprits[:5])))
        pending.append((self.total, s.total_norm, False))
        return out

    def state_dict(self) -> dict[str, Any]:
        return {"total": self.total.state_dict(),
                "layers": {k: b.state_dict() for k, b in self.layers.items()}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.discard()
        self.total.load_state_dict(state["total"])
        self.layers = {}
        for k, v in state["layers"].items():
            b = self.layers[k] = RobustBaseline(self.cfg.ema_alpha, self.cfg.min_rel_spread)
            b.load_state_dict(v)


class LossScaleDetector:
    """GradScaler health: overflow streaks, overflow rate over a window, scale collapse."""

    def __init__(self, cfg: DetectConfig) -> None:
        self.cfg = cfg
        self.streak = 0
        self.window: deque[int] = deque(maxlen=cfg.overflow_window)
        self._pending: bool = False  # a clean step's entry, applied by commit only

    def commit(self) -> None:
        """The step taught: a clean step ends the overflow streak and enters the rate window."""
        if self._pending:
            self.streak = 0
            self.window.append(0)
        self._pending = False

    def discard(self) -> None:
        """The step teaches nothing (a clean step that was skipped, rolled back or blamed on data)."""
        self._pending = False

    def restart(self) -> None:
        """After a rollback: the restored scale starts a fresh streak and window."""
        self.streak = 0
        self.window.clear()
        self._pending = False

    def observe(self, s: Signals) -> list[Finding]:
        self.commit()  # used on its own (no core settling each step), every observed step teaches
        if s.scale is None:
            return []
        cfg = self.cfg
        out = []
        # an overflow is this detector's event, counted at once (its streak and rate are the signal,
        # no baseline learns from it); a clean step enters only if it teaches (commit)
        if s.overflow:
            self.streak += 1
            self.window.append(1)
        else:
            self._pending = True
        streak = self.streak if s.overflow else 0
        window = list(self.window) if s.overflow else [*self.window, 0][-cfg.overflow_window:]
        if streak >= cfg.overflow_streak:
            out.append(Finding("overflow_streak", WARNING, s.step, value=streak,
                               threshold=cfg.overflow_streak, layers=list(s.nonfinite_layers),
                               message=f"{streak} consecutive fp16 overflows"))
        if len(window) == self.window.maxlen:
            rate = sum(window) / len(window)
            if rate > cfg.overflow_rate:
                out.append(Finding("overflow_rate", WARNING, s.step, value=rate, threshold=cfg.overflow_rate,
                                   message=f"overflow rate {rate:.0%} over {len(window)} steps"))
        if s.scale < cfg.scale_floor:
            out.append(Finding("scale_collapse", CRITICAL, s.step, value=s.scale, threshold=cfg.scale_floor,
                               layers=list(s.nonfinite_layers),
                               message=f"loss scale {s.scale:g} fell below {cfg.scale_floor:g}"))
        return out

    def state_dict(self) -> dict[str, Any]:
        return {"streak": self.streak, "window": list(self.window)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.discard()
        self.streak = state["streak"]
        self.window = deque(state["window"], maxlen=self.cfg.overflow_window)


class NormTakeoverDetector:
    """Quiet degradation: the final normalization layer takes the gradient, the body stops learning.

    Too high a learning rate does not always blow up. With clipping (every engine clips at 1.0 by
    default) each update is bounded, the loss never jumps, and the run settles on a plateau far
    above where a tuned run goes, with no spike for the spike detectors to see. Where the gradient
    goes gives it away. A model's final normalization layer (``transformer.ln_f``,
    ``model.norm``: a gain and a bias, a tiny fraction of the parameters) only sets the scale of
    the features the output head reads. In a run that learns it carries almost none of the
    gradient: at most 2% of the squared gradient norm in every healthy run we measured (LRs from
    1e-4 to 1e-2, batch 4 to 64, from scratch or fine-tuning, a transformer and a CNN), 0.2-0.4%
    in the HF GPT-2 runs of the report this rule comes from. When the LR is far too high, the
    body's features collapse and the cheapest way left to lower the loss is to rescale the logits:
    the final norm takes 60-99% of the gradient while the numbered blocks get 0.01-0.5% and barely
    learn.

    The signal is the final norm layers' share of the squared gradient norm, read from the
    per-layer norms measured every step (no extra pass). Its median over ``takeover_window``
    steps (one odd batch moves a median by one rank) above ``takeover_share`` is a finding,
    which the policy treats as an instability (rollback, lower LR). The window then starts over,
    so a persistent takeover is reported once per window. While the running median (half a window
    at least) is above the share, the run is *suspect*: snapshots taken then are not confirmed, so
    a rollback goes back to weights from before the takeover.

    A model without a standalone normalization layer (post-LN: every norm sits inside a block, as
    the last operation of its sublayer) is watched through the share of all its normalization
    parameters inside the blocks (batch norms left out). It is 2-3% in healthy post-LN runs (LRs
    1e-3 to 1e-2), 67-89% when the LR is far too high under clipping: the same signature.
    """

    def __init__(self, cfg: DetectConfig) -> None:
        self.cfg = cfg
        self.window: deque[float] = deque(maxlen=max(1, cfg.takeover_window))
        self.norm_layers: list[str] = []
        self.inner = False  # post-LN: the share of the norm parameters inside the blocks (Signals.inner_norm)
        self.body: list[str] = []
        self.onset: int | None = None  # first step of the current run of high medians
        self.findings = 0
        #: this step's share and onset, entered into the window by :meth:`commit` only
        self._pending: tuple[float, int | None] | None = None
        self._suspect = False

    def set_layers(self, layer_names: list[str], norm_layers: list[str], inner: bool = False) -> None:
        """``norm_layers``: the layers made only of normalization parameters (the engine knows the
        modules; see ``gradguard.measure.norm_layers``). ``inner``: the model has none, and the
        norm parameters inside its blocks are measured instead (``Signals.inner_norm``)."""
        body = set(body_layers(layer_names))
        self.norm_layers = [n for n in norm_layers if n in layer_names and n not in body]
        self.inner = inner and not self.norm_layers
        self.body = sorted(body)

    def _share(self, s: Signals, names: list[str]) -> float:
        return sum(s.layer_norms.get(n, 0.0) ** 2 for n in names) / s.total_norm ** 2

    def _norm_share(self, s: Signals) -> float | None:
        """The step's share of the watched norms (final norm layers, or the inner norms)."""
        if self.norm_layers:
            return self._share(s, self.norm_layers)
        if self.inner and s.inner_norm is not None and math.isfinite(s.inner_norm):
            return min(1.0, s.inner_norm ** 2 / s.total_norm ** 2)
        return None

    def _high(self, window: list[float] | deque[float]) -> bool:
        cfg = self.cfg
        return (cfg.takeover_share < 1 and len(window) >= max(1, cfg.takeover_window // 2)
                and statistics.median(window) > cfg.takeover_share)

    @property
    def suspect(self) -> bool:
        """At least half a window seen and its median above the share (this step's share included
        once observed, before the step is settled)."""
        return self._suspect or self._high(self.window)

    def commit(self) -> None:
        """The step taught: its share enters the window."""
        if self._pending is not None:
            self.window.append(self._pending[0])
            self.onset = self._pending[1]
        self._pending, self._suspect = None, False

    def discard(self) -> None:
        """The step teaches nothing: the window stays as it was."""
        self._pending, self._suspect = None, False

    def observe(self, s: Signals) -> list[Finding]:
        cfg = self.cfg
        self.commit()  # used on its own (no core settling each step), every observed step teaches
        if (cfg.takeover_share >= 1 or s.overflow or s.nonfinite_layers
                or not (s.total_norm > 0 and math.isfinite(s.total_norm))):
            return []
        share = self._norm_share(s)
        if share is None:
            return []
        window = [*self.window, share][-self.window.maxlen:]  # type: ignore[misc]
        self._suspect = self._high(window)
        if not self._suspect:
            self._pending = (share, None)
            return []
        onset = self.onset if self.onset is not None else s.step
        if len(window) < self.window.maxlen:  # type: ignore[operator]
            self._pending = (share, onset)
            return []
        med = statistics.median(window)
        self.window.clear()  # reported once per window: the window starts over whatever the step's verdict
        self.onset = None
        self.findings += 1
        takers = sorted(self.norm_layers, key=lambda n: -s.layer_norms.get(n, 0.0))
        who = ", ".join(takers) if takers else "the normalization layers inside the blocks"
        body = (f"; the {len(self.body)} numbered blocks get {self._share(s, self.body):.1%}"
                if self.body and takers else "")
        return [Finding(NORM_TAKEOVER, WARNING, s.step, value=med, threshold=cfg.takeover_share, baseline=onset,
                        layers=takers,
                        message=f"{who} take {med:.0%} of the gradient (median of the last "
                                f"{len(window)} steps, above {cfg.takeover_share:.0%} since step {onset}; healthy "
                                f"runs < 2%){body}: the model "
                                "mostly rescales its output instead of learning features, typical of a learning "
                                "rate too high for the model, hidden by clipping")]

    def reset(self) -> None:
        """Start over (after a rollback: the restored weights get a fresh window)."""
        self.window.clear()
        self.onset = None
        self.discard()

    def state_dict(self) -> dict[str, Any]:
        return {"window": list(self.window), "onset": self.onset, "findings": self.findings}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.discard()
        self.window = deque((float(v) for v in state["window"]), maxlen=max(1, self.cfg.takeover_window))
        self.onset = state["onset"]
        self.findings = int(state["findings"])


class Detectors:
    """All detectors, run in a fixed order."""

    def __init__(self, cfg: DetectConfig) -> None:
        self.nonfinite = NonFiniteDetector()
        self.loss = LossSpikeDetector(cfg)
        self.grad = GradSpikeDetector(cfg)
        self.scale = LossScaleDetector(cfg)
        self.takeover = NormTakeoverDetector(cfg)

    def _all(self) -> dict[str, Any]:
        return {"nonfinite": self.nonfinite, "loss": self.loss, "grad": self.grad, "scale": self.scale,
                "takeover": self.takeover}

    def observe(self, s: Signals) -> list[Finding]:
        """Judge one step against what the detectors learned so far. What the step would teach is
        only staged: :meth:`settle` applies or drops it once the step's fate is known."""
        out: list[Finding] = []
        moved = self.grad.moved_most(s.layer_norms)  # against the baselines before this step
        for det in self._all().values():
            found = det.observe(s)
            for f in found:
                if f.kind == "loss_spike" and not f.moved_layers:
                    f.moved_layers = moved
            out.extend(found)
        return out

    def settle(self, teach: bool) -> None:
        """Apply (``teach``) or drop every detector's staged lesson of the step just observed. The
        core calls this once per step with the verdict of ``gradguard.core.teaches``."""
        for det in self._learners():
            if teach:
                det.commit()
            else:
                det.discard()

    def restart(self) -> None:
        """After a rollback: windows and judgements in progress start over on the restored weights
        (the baselines are those restored with the snapshot)."""
        self.loss.restart()
        self.grad.discard()
        self.scale.restart()
        self.takeover.reset()

    def _learners(self) -> list[Any]:
        return [self.loss, self.grad, self.scale, self.takeover]

    def state_dict(self) -> dict[str, Any]:
        return {k: d.state_dict() for k, d in self._all().items()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for k, d in self._all().items():
            if k in state or k != "takeover":  # states saved before this detector existed lack it
                d.load_state_dict(state[k])
