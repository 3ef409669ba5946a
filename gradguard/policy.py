"""Policy: findings -> actions, as an escalation ladder with cooldowns, budgets and recovery."""

from __future__ import annotations

from collections import deque
from dataclasses import asdict, dataclass, field
from typing import Any

from .config import PolicyConfig
from .detect import NORM_TAKEOVER, Finding, Signals

__all__ = ["Action", "Decision", "Policy", "INSTABILITY_KINDS", "REPEAT_KINDS", "BATCH_KINDS"]

#: Findings that count as instability on their own (a norm takeover is the quiet kind: no spike).
INSTABILITY_KINDS = frozenset({"loss_spike", "overflow_rate", "scale_collapse", NORM_TAKEOVER})
#: Findings handled step by step (skip, clip) that count as instability once they repeat
#: (a grad spike only when critical: 10x its threshold).
REPEAT_KINDS = frozenset({"nonfinite_loss", "nonfinite_grad", "grad_spike"})
#: Findings one bad batch can raise on its own: with these alone, spikes on weights that no update
#: changed cannot tell bad data from damaged weights (see :meth:`Policy._ambiguous`).
BATCH_KINDS = frozenset({"loss_spike"}) | REPEAT_KINDS


@dataclass
class Action:
    """One change to training (or a halt), with why and with what parameters."""

    name: str
    step: int
    reason: str = ""
    params: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class Decision:
    """What the policy wants done with this step."""

    skip: bool = False
    skip_reason: str = ""
    actions: list[Action] = field(default_factory=list)
    halt: bool = False
    unstable: bool = False
    suspect: bool = False  # a spike handled by a skip: not healthy, not (yet) an instability
    data_verdict: bool = False  # a spike on verified (just restored) weights: the data is bad
    ambiguous: bool = False
    """Spikes on weights no update changed, at an LR that did not rise: a rollback without an LR
    cut (bad data or damaged weights cannot be told apart yet; see :meth:`Policy._ambiguous`)."""


class Policy:
    """Reads findings, returns a decision. Holds the ladder position and the budgets."""

    def __init__(self, cfg: PolicyConfig) -> None:
        self.cfg = cfg
        self.level = 0
        self.last_escalation: int | None = None
        self.escalations: deque[int] = deque()
        self.repeats: deque[int] = deque()
        self.skip_streak = 0
        self.healthy = 0
        self.last_spike: int | None = None
        #: consecutive steps skipped for a loss spike, no update applied in between (same weights)
        self.spike_chain = 0
        #: after an ambiguous rollback: until this step, a recurrence climbs the ladder (LR cut)
        self.probation_until: int | None = None

    def _trim(self, dq: deque[int], step: int) -> None:
        while dq and dq[0] <= step - self.cfg.escalation_window:
            dq.popleft()

    def decide(self, s: Signals, findings: list[Finding], grad_ratio: float,
               weights_verified: bool = False, lr_rose: bool = True) -> Decision:
        """``weights_verified``: no update was applied since the weights were restored from a
        healthy snapshot, so a spike now is blamed on the data (the step is skipped, no escalation).
        ``lr_rose``: the scheduled LR rises or rose a few steps ago, or the run has not made progress
        yet (a warm-up, a glitch, the first steps): repeated spikes are then the LR's, never ambiguous."""
        cfg = self.cfg
        d = Decision()
        kinds = self._verdict(s, findings, d, weights_verified)
        self._skip_step(s, kinds, grad_ratio, d)
        d.unstable = self._unstable(s, findings, kinds)
        spiked = "loss_spike" in {f.kind for f in findings}
        d.suspect = spiked and not d.unstable
        if not cfg.act:
            d.skip, d.skip_reason = False, ""
            return d
        if d.data_verdict:
            self.probation_until = None  # the data was to blame: the last rollback was right to keep the LR
        if d.unstable and spiked and not lr_rose and cfg.ambiguous_spikes and self._ambiguous(s, kinds):
            self._hold_judgement(s, d)
        self.spike_chain = self.spike_chain + 1 if (d.skip and spiked and not d.actions and not d.data_verdict) else 0
        self.skip_streak = self.skip_streak + 1 if d.skip else 0
        if self.skip_streak >= cfg.max_skip_streak:
            d.halt = True
            d.actions.append(Action("halt", s.step, f"{self.skip_streak} consecutive skipped steps"))
            return d
        if d.unstable:
            self._escalate(s, findings, d)
        elif not d.skip:
            self.healthy += 1
            if self.level > 0 and self.healthy >= cfg.escalation_window:
                self.level -= 1
                self.healthy = 0
        return d

    def _verdict(self, s: Signals, findings: list[Finding], d: Decision, weights_verified: bool) -> set[str]:
        """The findings that count: none on verified weights (the data is bad), an isolated loss
        spike handled by a skip (a second one soon after escalates)."""
        kinds = {f.kind for f in findings}
        spike = "loss_spike" in kinds
        if weights_verified and (spike or (REPEAT_KINDS | INSTABILITY_KINDS) & kinds):
            # nothing was applied since the restore: these weights are known good, the batch is not
            kinds -= REPEAT_KINDS | INSTABILITY_KINDS
            d.data_verdict = True
            d.skip, d.skip_reason = True, "spike on verified weights: bad data"
        elif spike and (self.last_spike is None or s.step - self.last_spike > self.cfg.spike_confirm_window):
            # an isolated spike may be one bad batch: skip it; a second one soon after escalates
            kinds.discard("loss_spike")
            self.last_spike = s.step
            d.skip, d.skip_reason = True, "loss spike (skipped; escalates if it repeats)"
        elif spike:
            self.last_spike = s.step
        return kinds

    def _ambiguous(self, s: Signals, kinds: set[str]) -> bool:
        """A repeated spike that cannot yet be blamed: the previous step was skipped for a spike (the
        weights are those the first spike came on), no instability finding but those one bad batch
        raises (:data:`BATCH_KINDS`; no takeover, overflow rate or scale collapse) and no ambiguous
        rollback is on probation. Two bad batches in a row look the same as damaged weights; only
        another batch on those weights, or a batch on restored ones, tells them apart."""
        on_probation = self.probation_until is not None and s.step <= self.probation_until
        return self.spike_chain >= 1 and not on_probation and not kinds & (INSTABILITY_KINDS - BATCH_KINDS)

    def _hold_judgement(self, s: Signals, d: Decision) -> None:
        """The second spike on unchanged weights is skipped; the third rolls back without an LR cut or
        a ladder climb. A spike on the restored weights then blames the data; a clean batch on them
        takes training back to the weights left, on trial (the core: ``GuardCore._trial_return``).
        A recurrence during the probation (``probation_until``: the replay of the lost steps, if
        any, then two spike-confirm windows) climbs the ladder as usual."""
        d.unstable, d.suspect, d.skip = False, True, True
        if self.spike_chain == 1:
            d.skip_reason = ("loss spike again on unchanged weights at a steady LR "
                             "(skipped; bad data or damaged weights)")
            return
        window = self.cfg.spike_confirm_window
        d.ambiguous, d.skip_reason = True, ""  # the core names the outcome (rolled back, or no snapshot)
        self.probation_until = s.step + 2 * window
        d.actions.append(Action("rollback", s.step, f"{self.spike_chain + 1} loss spikes in a row on unchanged "
                                "weights at a steady LR: bad data or damaged weights; rolled back without an LR "
                                f"cut (a spike on the weights left, or a recurrence within {2 * window} steps, "
                                "cuts it)",
                                {"ambiguous": True}))

    def extend_probation(self, steps_lost: int) -> None:
        """An ambiguous rollback restored weights ``steps_lost`` steps back: the probation covers the
        replay of those steps too."""
        if self.probation_until is not None:
            self.probation_until += max(0, int(steps_lost))

    def start_probation(self, step: int) -> None:
        """Back on the weights the spikes came on (nothing to replay): a recurrence within two
        spike-confirm windows climbs the ladder."""
        self.probation_until = step + 2 * self.cfg.spike_confirm_window

    def _skip_step(self, s: Signals, kinds: set[str], grad_ratio: float, d: Decision) -> None:
        if ({"nonfinite_loss", "nonfinite_grad"} & kinds) and self.cfg.skip_nonfinite:
            d.skip, d.skip_reason = True, "non-finite " + ("loss" if "nonfinite_loss" in kinds else "gradients")
        elif s.overflow:
            d.skip, d.skip_reason = True, f"fp16 overflow (scale {s.scale:g})"
        elif grad_ratio > self.cfg.skip_grad_ratio:
            d.skip, d.skip_reason = True, f"grad norm {grad_ratio:.0f}x its baseline"

    def _unstable(self, s: Signals, findings: list[Finding], kinds: set[str]) -> bool:
        """An instability finding, or handled-step-by-step findings that repeat (a grad spike only
        when critical: 10x its threshold; moderate ones are routine with small batches)."""
        self._trim(self.repeats, s.step)
        self._trim(self.escalations, s.step)
        unstable = bool(INSTABILITY_KINDS & kinds)
        severe_grad = "grad_spike" in kinds and any(f.kind == "grad_spike" and f.severity == "critical"
                                                    for f in findings)
        if ({"nonfinite_loss", "nonfinite_grad"} & kinds) or severe_grad:
            self.repeats.append(s.step)
            if len(self.repeats) >= self.cfg.repeats_to_escalate:
                unstable = True
                self.repeats.clear()
        return unstable

    def _escalate(self, s: Signals, findings: list[Finding], d: Decision) -> None:
        """One rung up the ladder unless cooling down; too many escalations in a window halt."""
        cfg = self.cfg
        self.healthy = 0
        if self.last_escalation is not None and s.step - self.last_escalation <= cfg.cooldown:
            return
        reason = "; ".join(f.message for f in findings if f.kind in INSTABILITY_KINDS | REPEAT_KINDS)
        rung = cfg.ladder[min(self.level, len(cfg.ladder) - 1)]
        self.level += 1
        self.last_escalation = s.step
        self.escalations.append(s.step)
        if len(self.escalations) > cfg.max_escalations:
            d.halt = True
            d.actions.append(Action("halt", s.step,
                                    f"{len(self.escalations)} escalations within {cfg.escalation_window} steps"))
            return
        for name in rung:
            if name == "halt":
                d.halt = True
            d.actions.append(Action(name, s.step, reason, {"rung": self.level}))

    def state_dict(self) -> dict[str, Any]:
        return {"level": self.level, "last_escalation": self.last_escalation,
                "escalations": list(self.escalations), "repeats": list(self.repeats),
                "skip_streak": self.skip_streak, "healthy": self.healthy, "last_spike": self.last_spike,
                "spike_chain": self.spike_chain, "probation_until": self.probation_until}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.level = state["level"]
        self.last_escalation = state["last_escalation"]
        self.escalations = deque(state["escalations"])
        self.repeats = deque(state["repeats"])
        self.skip_streak = state["skip_streak"]
        self.healthy = state["healthy"]
        self.last_spike = state["last_spike"]
        # states saved before the ambiguous-spike rule have neither entry
        self.spike_chain = int(state.get("spike_chain", 0))
        self.probation_until = state.get("probation_until")
