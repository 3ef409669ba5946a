"""Compound benchmark: generated runs in which two things happen, on model families the rules were
not tuned on. The regression gate of the decision rules: no scenario may be *harmed* (guarded worse
than unguarded by more than 0.5%).

    python benchmarks/compound.py                      # master seed 0, plain loop, all families
    python benchmarks/compound.py --master-seed 1      # a fresh held-out draw
    python benchmarks/compound.py --models gpt,llama --steps 120
    python benchmarks/compound.py --engine hf --models gpt,conv   # the same runs under the HF Trainer
    python benchmarks/compound.py --jitter 4           # + the noise band: 4 unguarded runs at LR x1.001..1.004

Every run's seed and fault onset are drawn from the master seed (printed), so a new master seed is
a new held-out set. Scenarios (each on every model family):

* ``garbage``: a window of uniform random bytes (a binary file in a text shard), then healthy training;
* ``garbage_high_lr``: the same window during an LR 3x too high;
* ``late_spike``: the LR x30 for a few steps late in the cosine decay;
* ``finetune_bad_batch``: fine-tuning from a pre-trained start, one bad batch (embeddings x100);
* ``quiet_after_spike``: a NaN early, then an LR far too high under clip 1.0 (a quiet plateau);
* ``warmup_overshoot``: an LR 10x or 33x too high (drawn), reached through the warm-up: the run
  blows up on the ramp (no other fault; the reference is the tuned LR);
* ``garbage_short``: a garbage window of 2 batches, and one of 1, 3 or 4 (drawn), mid-decay: two
  bad batches in a row on weights no update changed look like damaged weights;
* ``healthy``: no fault (counts the guard's actions on a healthy run).

Onsets are drawn from early / middle / late in the decay. Families: ``gpt`` (pre-LN, LayerNorm, a
final norm), ``llama`` (pre-norm RMSNorm, SwiGLU, a final RMSNorm), ``postln`` (post-LN: the norms
inside the blocks, no final norm), ``conv`` (a gated causal CNN). The reference of a fault run is
the same run without its fault (for a too-high LR: at the tuned LR). Per arm: *rescued* (within 5%
of the reference), *harmed* (worse than unguarded by more than 0.5%), actions on healthy runs.
With ``--jitter K`` every row also trains K unguarded copies at the LR x (1 + 0.001 k): a change that
should not matter. Their spread is the run's noise band (up to 1% at a too-high LR: 150 steps at a
too-high LR are chaotic), and the summary adds the runs harmed beyond it. A row harmed beyond it also
trains K gradguard copies at the same LRs: harmed *beyond both bands* when every guarded run is
worse than the unguarded band's top by more than 0.5% (the harm is not the guarded run's own noise).

Engines (``--engine``): ``plain`` (the loop below, ``gradguard.Guard``), ``hf`` (``transformers.Trainer``
with ``gradguard.hf.GradGuardCallback``) and ``lightning`` (Lightning's ``Trainer`` with
``gradguard.lightning.GradGuardCallback``): the same runs (model and start, data order, faults, optimizer,
schedule, clip, eval batches), unguarded and guarded; the engine runners are in
``benchmarks/compound_engines.py``. Results: ``results/compound-seed<N>[-<engine>]<tag>.md`` (no engine
part for the plain loop).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, replace
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from common import RESULTS_DIR, ARCArm, ConvLM, GradGuardArm, Unguarded, ZClipArm, environment, get_data, write_results  # noqa: E402

from gradguard.demo_model import TinyGPT, evaluate  # noqa: E402

SEQ, WIDTH, BATCH = 32, 64, 16
TUNED_LR = 3e-3
RESCUED, HARMED = 1.05, 1.005
#: ``--jitter K``: K more unguarded runs at the LR x (1 + JITTER * k), k = 1..K: the noise band of a run
JITTER = 1e-3
ENGINE_NAMES = {"plain": "plain loop", "hf": "HF Trainer + gradguard.hf.GradGuardCallback",
                "lightning": "Lightning Trainer + gradguard.lightning.GradGuardCallback"}


# -- model families ---------------------------------------------------------------------------------
class RMSNorm(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.weight


class LlamaBlock(nn.Module):
    def __init__(self, width: int, n_head: int) -> None:
        super().__init__()
        self.n1, self.n2 = RMSNorm(width), RMSNorm(width)
        self.attn = nn.MultiheadAttention(width, n_head, bias=False, batch_first=True)
        self.gate, self.up = nn.Linear(width, 2 * width, bias=False), nn.Linear(width, 2 * width, bias=False)
        self.down = nn.Linear(2 * width, width, bias=False)

    def forward(self, h: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        a = self.n1(h)
        h = h + self.attn(a, a, a, attn_mask=mask, need_weights=False)[0]
        m = self.n2(h)
        return h + self.down(F.silu(self.gate(m)) * self.up(m))


class TinyLlama(nn.Module):
    """Pre-norm RMSNorm decoder (tok_emb, blocks.N, ln_f = final RMSNorm, lm_head), no biases."""

    def __init__(self, n_layer: int = 2, width: int = WIDTH, n_head: int = 4, seq_len: int = SEQ) -> None:
        super().__init__()
        self.tok_emb = nn.Embedding(256, width)
        self.pos_emb = nn.Embedding(seq_len, width)
        self.blocks = nn.ModuleList(LlamaBlock(width, n_head) for _ in range(n_layer))
        self.ln_f = RMSNorm(width)
        self.lm_head = nn.Linear(width, 256, bias=False)
        self.register_buffer("mask", torch.triu(torch.full((seq_len, seq_len), -math.inf), 1), persistent=False)
        for m in self.modules():
            if isinstance(m, (nn.Linear, nn.Embedding)):
                nn.init.normal_(m.weight, std=0.02)

    def forward(self, x: torch.Tensor, y: torch.Tensor | None = None) -> torch.Tensor:
        t = x.shape[1]
        h = self.tok_emb(x) + self.pos_emb(torch.arange(t, device=x.device))
        for b in self.blocks:
            h = b(h, self.mask[:t, :t])
        logits = self.lm_head(self.ln_f(h))
        return logits if y is None else F.cross_entropy(logits.reshape(-1, 256), y.reshape(-1))


class PostLN(nn.Module):
    """Post-LN transformer (the original recipe): LayerNorms inside the blocks, after each residual
    add; no final norm layer (the norm-takeover rule has nothing to watch)."""

    def __init__(self, n_layer: int = 2, width: int = WIDTH, n_head: int = 4, seq_len: int = SEQ) -> None:
        super().__init__()
        self.tok_emb = nn.Embedding(256, width)
        self.pos_emb = nn.Embedding(seq_len, width)
        self.blocks = nn.ModuleList(
            nn.TransformerEncoderLayer(width, n_head, 2 * width, dropout=0.0, batch_first=True, norm_first=False)
            for _ in range(n_layer))
        self.lm_head = nn.Linear(width, 256, bias=False)
        self.register_buffer("mask", torch.triu(torch.full((seq_len, seq_len), -math.inf), 1), persistent=False)

    def forward(self, x: torch.Tensor, y: torch.Tensor | None = None) -> torch.Tensor:
        t = x.shape[1]
        h = self.tok_emb(x) + self.pos_emb(torch.arange(t, device=x.device))
        for b in self.blocks:
            h = b(h, src_mask=self.mask[:t, :t])
        logits = self.lm_head(h)
        return logits if y is None else F.cross_entropy(logits.reshape(-1, 256), y.reshape(-1))


class HFGPT2(nn.Module):
    """transformers' GPT2LMHeadModel built from a config (3 blocks): the model of the issue's case."""

    def __init__(self) -> None:
        super().__init__()
        from transformers import GPT2Config, GPT2LMHeadModel

        cfg = GPT2Config(vocab_size=256, n_positions=SEQ, n_embd=WIDTH, n_layer=3, n_head=4, bos_token_id=0, eos_token_id=0,
                         resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
        self.gpt = GPT2LMHeadModel(cfg)
        self.tok_emb = self.gpt.transformer.wte

    def forward(self, x: torch.Tensor, y: torch.Tensor | None = None) -> torch.Tensor:
        logits = self.gpt(input_ids=x).logits
        return logits if y is None else F.cross_entropy(logits.reshape(-1, 256), y.reshape(-1))


#: selectable with --models, not in the default draw
EXTRA_FAMILIES = {"gpt2hf": lambda: HFGPT2()}

FAMILIES = {
    "gpt": lambda: TinyGPT(n_layer=2, width=WIDTH, n_head=4, seq_len=SEQ),
    "llama": lambda: TinyLlama(),
    "postln": lambda: PostLN(),
    "conv": lambda: ConvLM(width=WIDTH, n_layer=3),
}


# -- scenarios ----------------------------------------------------------------------------------------
@dataclass
class Run:
    scenario: str
    model: str
    seed: int
    steps: int
    lr: float
    onset: int = 0
    fault: str | None = None  # garbage | lr_spike | embed_x100 | nan
    fault_len: int = 0
    clip: float | None = None
    warmup_frac: float = 0.1
    pre_steps: int = 0
    second: str | None = None  # a second event: "quiet" (the LR far too high from the second onset)
    healthy: bool = False

    def in_fault(self, step: int) -> bool:
        return self.fault is not None and self.onset <= step < self.onset + self.fault_len

    def reference(self) -> Run:
        """The same run without its fault, at the tuned LR when the LR was the problem."""
        lr = TUNED_LR if self.scenario in ("garbage_high_lr", "quiet_after_spike", "warmup_overshoot") else self.lr
        return replace(self, fault=None, fault_len=0, lr=lr, second=None, clip=self.clip)


def draw(master: int, models: list[str], steps: int) -> list[Run]:
    """The runs of one master seed: per scenario and model a seed and an onset phase."""
    rng = random.Random(master)
    phase = {"early": (0.15, 0.3), "middle": (0.4, 0.6), "late": (0.7, 0.85)}
    runs: list[Run] = []
    for model in models:
        def onset(which: str) -> int:
            lo, hi = phase[which]
            return int(steps * rng.uniform(lo, hi))

        def seed() -> int:
            return rng.randrange(10_000)

        for which in ("early", "middle", "late"):
            runs.append(Run("garbage", model, seed(), steps, 1e-2 if model != "conv" else TUNED_LR,
                            onset=onset(which), fault="garbage", fault_len=rng.randint(6, 12)))
        runs.append(Run("garbage_high_lr", model, seed(), steps, 3e-2, onset=onset("middle"),
                        fault="garbage", fault_len=rng.randint(6, 12)))
        runs.append(Run("late_spike", model, seed(), steps, TUNED_LR, onset=onset("late"), fault="lr_spike",
                        fault_len=rng.randint(3, 6)))
        runs.append(Run("finetune_bad_batch", model, seed(), steps, 3e-4, onset=onset("middle"),
                        fault="embed_x100", fault_len=1, warmup_frac=0.0, pre_steps=100))
        runs.append(Run("quiet_after_spike", model, seed(), steps, 0.1, onset=onset("early"), fault="nan",
                        fault_len=1, clip=1.0, warmup_frac=0.0))
        runs.append(Run("healthy", model, seed(), steps, TUNED_LR, healthy=True))
    # drawn from a stream of their own, so adding them left every run above as it was
    extra = random.Random(1_000_003 * (master + 1))
    for model in models:
        runs.append(Run("warmup_overshoot", model, extra.randrange(10_000), steps, extra.choice((3e-2, 1e-1))))
    # short garbage windows, drawn from a stream of their own too (added 2026-12-04)
    short = random.Random(2_000_003 * (master + 1))
    for model in models:
        for length in (2, short.choice((1, 3, 4))):
            runs.append(Run("garbage_short", model, short.randrange(10_000), steps,
                            1e-2 if model != "conv" else TUNED_LR, onset=int(steps * short.uniform(0.4, 0.6)),
                            fault="garbage", fault_len=length))
    return runs


def issue_case(model: str, steps: int = 300) -> list[Run]:
    """The reported case (``--scenarios issue26``): lr 1e-2, 20 warm-up steps then cosine, a window of
    12 garbage batches at the middle of the run."""
    return [Run("issue26", model, 0, steps, 1e-2, onset=steps // 2, fault="garbage", fault_len=12,
                warmup_frac=20 / steps)]


# -- one run ---------------------------------------------------------------------------------------
def start(run: Run) -> tuple[nn.Module, Any]:
    """The run's model at its start (after the pre-training of a fine-tuning run) and its data."""
    torch.manual_seed(run.seed)
    data = get_data(SEQ)
    model = {**FAMILIES, **EXTRA_FAMILIES}[run.model]()
    if run.pre_steps:
        pre = torch.optim.AdamW(model.parameters(), lr=TUNED_LR, weight_decay=0.01)
        pg = torch.Generator().manual_seed(20_000 + run.seed)
        for s in range(run.pre_steps):
            for g in pre.param_groups:
                g["lr"] = TUNED_LR * min(1.0, (s + 1) / 20)
            x, y = data.train_batch(32, pg)
            model(x, y).backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            pre.step()
            pre.zero_grad(set_to_none=True)
    return model, data


def optimizer(run: Run, model: nn.Module) -> tuple[torch.optim.Optimizer, Any]:
    """AdamW(0.9, 0.95), weight decay 0.01; a LambdaLR: warm-up then cosine, times 30 in an LR spike."""
    opt = torch.optim.AdamW(model.parameters(), lr=run.lr, betas=(0.9, 0.95), weight_decay=0.01)
    warm = int(run.warmup_frac * run.steps)

    def lam(s: int) -> float:  # warm-up then cosine; the LR-spike fault multiplies it
        f = (s + 1) / warm if warm and s < warm else 0.5 * (1 + math.cos(math.pi * (s - warm) / max(1, run.steps - warm)))
        return f * (30.0 if run.fault == "lr_spike" and run.in_fault(s + 1) else 1.0)

    return opt, torch.optim.lr_scheduler.LambdaLR(opt, lam)


def batches(run: Run, data: Any, n: int | None = None) -> Any:
    """The training batches of steps 1..n (default: the run's steps), garbage at the fault steps of a
    ``garbage`` run (the clean batch of that step is drawn and dropped, as a shard holding it would)."""
    gen = torch.Generator().manual_seed(run.seed)
    noise = torch.Generator().manual_seed(50_000 + run.seed)
    for step in range(1, (n or run.steps) + 1):
        x, y = data.train_batch(BATCH, gen)
        if run.fault == "garbage" and run.in_fault(step):
            stream = torch.randint(0, 256, (BATCH, SEQ + 1), generator=noise)
            x, y = stream[:, :-1].contiguous(), stream[:, 1:].contiguous()
        yield x, y


def fault_hooks(run: Run, model: nn.Module, step_now: Any) -> list[Any]:
    """The forward-hook faults (embeddings x100, a NaN) at the steps ``step_now()`` (1-based) says."""
    def hook(m: nn.Module, i: Any, out: torch.Tensor) -> torch.Tensor | None:
        if not m.training or not run.in_fault(step_now()):
            return None
        if run.fault == "embed_x100":
            return out * 100.0
        if run.fault == "nan":
            return out + float("nan")
        return None

    return [model.tok_emb.register_forward_hook(hook)]


def eval_batches(data: Any) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return data.eval_batches(64, 4)


#: the peers (plain loop only): ZClip and ARC as their READMEs show, the user's clip kept by ARC
PEERS = {"zclip": ZClipArm, "arc": ARCArm}


def train(run: Run, arm_name: str, engine: str = "plain") -> dict[str, Any]:
    guarded = arm_name not in ("unguarded", "reference")
    if engine != "plain":
        from compound_engines import ENGINES

        return ENGINES[engine](sys.modules[__name__], run, guarded)
    model, data = start(run)
    opt, sched = optimizer(run, model)
    arm = PEERS[arm_name]() if arm_name in PEERS else GradGuardArm("default") if guarded else Unguarded()
    arm.user_clip = run.clip
    tmp = tempfile.TemporaryDirectory(prefix="gg-compound-")
    arm.attach(model, opt, sched, None, tmp.name)
    step = 0
    hooks = fault_hooks(run, model, lambda: step)
    skipped = 0
    for step, (x, y) in enumerate(batches(run, data), 1):  # noqa: B007 (the hooks read it)
        loss = model(x, y)
        loss.backward()
        o = arm.step(loss)
        opt.zero_grad(set_to_none=True)
        skipped += not o.applied
        if o.stop:
            break
    for h in hooks:
        h.remove()
    ev = evaluate(model, eval_batches(data))
    extra = arm.finish()
    tmp.cleanup()
    acts = {k: v for k, v in extra.get("guard_actions", {}).items()}
    return {"eval": ev if math.isfinite(ev) else float("inf"), "skipped": skipped, "actions": acts,
            "halted": extra.get("halted"), "events": extra.get("events", [])}


def judge(rows: list[dict[str, Any]]) -> dict[str, Any]:
    faults = [r for r in rows if not r["healthy"]]
    out = {"runs": len(rows)}
    for arm in ("unguarded", "gradguard", *(p for p in PEERS if rows and p in rows[0])):
        out[arm] = {"rescued": sum(r[arm]["eval"] <= RESCUED * r["reference"]["eval"] for r in faults),
                    "of": len(faults),
                    "harmed": [f"{r['scenario']}/{r['model']}" for r in rows
                               if r[arm]["eval"] > HARMED * r["unguarded"]["eval"]]}
    banded = [r for r in rows if r.get("jitter")]
    if banded:
        for arm in ("gradguard", *(p for p in PEERS if p in rows[0])):
            out[arm]["harmed_beyond_noise"] = [f"{r['scenario']}/{r['model']}" for r in banded
                                               if r[arm]["eval"] > HARMED * band(r)[1]]
        out["harmed_beyond_noise"] = out["gradguard"]["harmed_beyond_noise"]
        # the guarded side's own band, trained only for the rows harmed beyond the unguarded one
        out["harmed_beyond_both"] = [f"{r['scenario']}/{r['model']}" for r in banded if r.get("jitter_guarded")
                                     and guarded_band(r)[0] > HARMED * band(r)[1]]
    out["harmed"] = out["gradguard"]["harmed"]
    healthy = [r for r in rows if r["healthy"]]
    out["healthy_actions"] = sum(sum(r["gradguard"]["actions"].values()) for r in healthy)
    out["healthy_runs"] = len(healthy)
    return out


def band(row: dict[str, Any]) -> tuple[float, float]:
    """(lowest, highest) final loss of the unguarded run and its LR-jittered copies."""
    evals = [row["unguarded"]["eval"], *(j["eval"] for j in row.get("jitter") or [])]
    return min(evals), max(evals)


def guarded_band(row: dict[str, Any]) -> tuple[float, float]:
    """(lowest, highest) final loss of the gradguard run and its copies at the jittered LRs (the
    copies exist only for a row harmed beyond the unguarded band)."""
    evals = [row["gradguard"]["eval"], *(j["eval"] for j in row.get("jitter_guarded") or [])]
    return min(evals), max(evals)


def markdown(doc: dict[str, Any]) -> str:
    s = doc["summary"]
    peers = [p for p in PEERS if p in s]
    jit = "harmed_beyond_noise" in s
    lines = [f"# Compound benchmark, master seed {doc['master_seed']}", "",
             f"{s['runs']} runs ({ENGINE_NAMES[doc.get('engine', 'plain')]}, {doc['steps']} steps, AdamW 0.9/0.95, "
             "10% warm-up + cosine). "
             f"Rescued: within {RESCUED - 1:.0%} of the reference; harmed: guarded > unguarded x {HARMED}.", "",
             f"- unguarded rescued {s['unguarded']['rescued']}/{s['unguarded']['of']}; gradguard rescued "
             f"{s['gradguard']['rescued']}/{s['gradguard']['of']}",
             f"- harmed: {len(s['harmed'])} {s['harmed'] or ''}",
             f"- actions on {s['healthy_runs']} healthy runs: {s['healthy_actions']}",
             *([f"- harmed beyond the noise band (gradguard > x {HARMED} the highest of the unguarded run and "
                f"{len(doc['rows'][0].get('jitter') or [])} copies at the LR x 1.001, 1.002, ...; a change this small "
                f"should not matter): {len(s['harmed_beyond_noise'])} {s['harmed_beyond_noise'] or ''}"] if jit else []),
             *([f"- of those, harmed beyond both bands (the gradguard run and its copies at the same jittered LRs "
                f"all above that top x {HARMED}; the guarded band is in brackets in the table): "
                f"{len(s['harmed_beyond_both'])} {s['harmed_beyond_both'] or ''}"] if "harmed_beyond_both" in s else []),
             *(f"- peer {p}: rescued {s[p]['rescued']}/{s[p]['of']}, harmed {len(s[p]['harmed'])} {s[p]['harmed'] or ''}"
               + (f"; beyond the noise band {len(s[p]['harmed_beyond_noise'])}" if jit else "")
               for p in PEERS if p in s), "",
             "| scenario | model | seed | onset | reference | unguarded | " + ("unguarded band | " if jit else "")
             + "gradguard | g/u | " + "".join(f"{p} | " for p in peers) + "actions |",
             "|---|---|---|---|---|---|---|---|" + "---|" * (len(peers) + jit) + "---|"]
    for r in doc["rows"]:
        g, u, ref = r["gradguard"]["eval"], r["unguarded"]["eval"], r["reference"]["eval"]
        acts = ", ".join(f"{k} {v}" for k, v in sorted(r["gradguard"]["actions"].items())) or "-"
        name = r["scenario"] + (f" (lr {r['lr']:g})" if r["scenario"] == "warmup_overshoot" else
                                f" ({r['fault_len']})" if r["scenario"] == "garbage_short" else "")
        lo, hi = band(r)
        gb = " ({:.3f}-{:.3f})".format(*guarded_band(r)) if r.get("jitter_guarded") else ""
        lines.append(f"| {name} | {r['model']} | {r['seed']} | {r['onset']} | {ref:.3f} | {u:.3f} | "
                     + (f"{lo:.3f}-{hi:.3f} | " if jit else "") + f"{g:.3f}{gb} | {g / u:.3f} | " + "".join(f"{r[p]['eval']:.3f} | " for p in peers) + f"{acts} |")
    return "\n".join(lines) + "\n"


def _key(row: dict[str, Any]) -> str:
    return json.dumps({k: row[k] for k in asdict(Run("", "", 0, 0, 0.0))}, sort_keys=True)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--master-seed", type=int, default=0)
    ap.add_argument("--models", default=",".join(FAMILIES))
    ap.add_argument("--scenarios", default="")
    ap.add_argument("--steps", type=int, default=150)
    ap.add_argument("--tag", default="")
    ap.add_argument("--engine", choices=("plain", "hf", "lightning"), default="plain",
                    help="the training engine of every arm (default: the plain loop)")
    ap.add_argument("--peers", default="", help="comma-separated peer arms to run too (plain loop): "
                    + ", ".join(PEERS))
    ap.add_argument("--reuse-guarded", action="store_true", help="with --reuse: keep its gradguard runs too "
                    "(to add --peers to a finished run)")
    ap.add_argument("--jitter", type=int, default=0, metavar="K",
                    help=f"K more unguarded runs per row at the LR x (1 + {JITTER:g} k): the band a change "
                    "that should not matter moves the final loss by; the summary adds the runs harmed beyond it")
    ap.add_argument("--reuse", default="", help="a results JSON of the same master seed whose reference and "
                    "unguarded runs are reused (they involve no gradguard code): only the guarded arm runs")
    args = ap.parse_args(argv)
    if args.peers and (args.engine != "plain" or set(args.peers.split(",")) - set(PEERS)):
        ap.error(f"--peers: plain loop only, from {sorted(PEERS)}")
    torch.set_num_threads(1)
    runs = draw(args.master_seed, args.models.split(","), args.steps)
    if args.scenarios == "issue26":
        runs = [r for m in args.models.split(",") for r in issue_case(m, args.steps)]
    elif args.scenarios:
        runs = [r for r in runs if r.scenario in args.scenarios.split(",")]
    print(f"master seed {args.master_seed}: {len(runs)} runs, engine {args.engine}", flush=True)
    rows, t0 = [], time.time()
    reuse: dict[str, Any] = {}
    if args.reuse:
        with open(args.reuse, encoding="utf-8") as fh:
            old_doc = json.load(fh)
        if old_doc.get("engine", "plain") != args.engine:
            ap.error(f"--reuse: {args.reuse} was run with --engine {old_doc.get('engine', 'plain')}")
        reuse = {_key(r): r for r in old_doc["rows"]}
    for i, run in enumerate(runs, 1):
        row = {**asdict(run)}
        old = reuse.get(_key(row))
        if old is not None:
            row["reference"], row["unguarded"] = old["reference"], old["unguarded"]
        else:
            row["reference"] = train(run.reference(), "reference", args.engine) if not run.healthy else None
            row["unguarded"] = train(run, "unguarded", args.engine)
        reuse_guarded = args.reuse_guarded and old is not None and "gradguard" in old
        row["gradguard"] = old["gradguard"] if reuse_guarded else train(run, "gradguard", args.engine)
        old_jitter = (old or {}).get("jitter") or []
        row["jitter"] = [*old_jitter[:args.jitter],
                         *(train(replace(run, lr=run.lr * (1 + JITTER * k)), "unguarded", args.engine)
                           for k in range(len(old_jitter) + 1, args.jitter + 1))]
        harmed = row["jitter"] and row["gradguard"]["eval"] > HARMED * band(row)[1]
        old_jg = (old or {}).get("jitter_guarded") or [] if reuse_guarded else []
        row["jitter_guarded"] = [] if not harmed else [
            *old_jg[:args.jitter], *(train(replace(run, lr=run.lr * (1 + JITTER * k)), "gradguard", args.engine)
                                    for k in range(len(old_jg) + 1, args.jitter + 1))]
        for peer in filter(None, args.peers.split(",")):
            row[peer] = (old or {}).get(peer) or train(run, peer)
        if row["reference"] is None:
            row["reference"] = row["unguarded"]
        rows.append(row)
        print(f"[{i}/{len(runs)}] {run.scenario}/{run.model} ref {row['reference']['eval']:.3f} "
              f"unguarded {row['unguarded']['eval']:.3f} gradguard {row['gradguard']['eval']:.3f} "
              f"{row['gradguard']['actions']} ({time.time() - t0:.0f}s)", flush=True)
    doc = {"master_seed": args.master_seed, "steps": args.steps, "engine": args.engine, "rows": rows,
           "summary": judge(rows), "environment": environment(), "seconds": round(time.time() - t0)}
    engine = "" if args.engine == "plain" else f"-{args.engine}"
    write_results(os.path.join(RESULTS_DIR, f"compound-seed{args.master_seed}{engine}{args.tag}"), doc, markdown(doc))
    print(markdown(doc))
    return doc


if __name__ == "__main__":
    main()
