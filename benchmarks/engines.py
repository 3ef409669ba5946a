"""Overhead inside the engines users run: HF ``Trainer``, Lightning ``Trainer`` and the plain loop.

Run through ``benchmarks/overhead.py --engines hf,lightning,plain`` (see its docstring). Every variant
trains the same model (same initial weights, same batches) for ``steps`` optimizer steps in a fresh
engine. The variants of a round run *interleaved step by step* in one process (:class:`Baton`): each
run is a thread, only the holder of the baton runs, and at every step end it hands the baton to the
next variant, so all of them advance one step each in turn and share every fast or slow second of the
machine; the process is pinned to one core (no migration between steps). A variant's step time is its
own active time from step ``warm`` to the last step, divided by the steps (the mean: work that comes
every N steps is included). The ratio of a variant is taken against its baseline *in the same round*,
and rounds rotate the order and build fresh model instances; the table gives the median [min, max]
of the per-round ratios. Why rounds still differ by about +-1%: a fresh instance of the same model
runs about 1% faster or slower for its whole life (where its tensors landed in memory), whatever the
variant; the median over rounds takes that out.

Variants (``clip`` is the unguarded engine with its own clipping at 1.0, the baseline):

* HF: ``none`` (``max_grad_norm=0``: transformers 5 still computes the total norm for its
  ``grad_norm`` log), ``clip`` (``max_grad_norm=1.0``), ``monitor`` and ``default``
  (``GradGuardCallback`` with that preset; ``max_grad_norm=1.0`` is replayed / becomes the guard's clip).
* Lightning: ``none`` (no clipping), ``clip`` (``gradient_clip_val=1.0``), ``grad_norm_log``
  (``clip`` plus Lightning's documented ``grad_norm`` logging in ``on_before_optimizer_step``),
  ``monitor`` and ``default`` (``gradient_clip_val=1.0``).
* plain loop: ``none``, ``clip`` (``clip_grad_norm_(1.0)``), ``monitor`` (``guard.step`` with the
  monitor preset and ``clip={"mode": "fixed", "max_norm": 1.0}``: the user's clip applied by the
  guard, bit-identical to ``clip_grad_norm_``, from its one pass; vs ``clip``), ``default``
  (``Guard`` default preset clipping at 1.0, vs ``clip``).

Garbage collection: a full ``gc.collect()`` runs at the end of step ``warm`` in every variant alike,
before the steady-state clock starts. Without it, the one-off full collection of the objects the
engine (and the previous run) left behind lands inside the window in some runs and not in others
(100-700 ms on a 2-3 s window: the size of the differences the table is meant to resolve). The
collections that still run inside the window are counted and timed (``gc_ms_per_step``,
``gc_full``) beside each result.

On CUDA (``--device cuda``) the model is GPT-2-small-sized (built from a config), bf16 autocast, and
one steady-state step of every variant runs under ``torch.cuda.set_sync_debug_mode("warn")``: the
synchronizing calls it flags are counted (the engine's own included; the guard adds one).
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import os
import statistics
import tempfile
import threading
import time
import warnings
from collections.abc import Callable
from typing import Any

import torch

import gradguard as gg
from gradguard.demo_model import load_corpus

#: model size -> settings (CPU sizes are Llama models from a config; "gpt2-small" is the CUDA one)
SIZES: dict[str, dict[str, Any]] = {
    "small": {"arch": "llama", "layers": 4, "width": 128, "heads": 4, "inter": 344, "vocab": 256, "batch": 16,
              "seq": 64, "desc": "Llama, 4 layers, width 128, batch 16 x 64 tokens"},
    "large": {"arch": "llama", "layers": 8, "width": 256, "heads": 8, "inter": 688, "vocab": 256, "batch": 8,
              "seq": 128, "desc": "Llama, 8 layers, width 256, batch 8 x 128 tokens"},
    "tiny": {"arch": "llama", "layers": 2, "width": 32, "heads": 2, "inter": 64, "vocab": 256, "batch": 4,
             "seq": 16, "desc": "Llama, 2 layers, width 32 (harness test only)"},
    "gpt2-small": {"arch": "gpt2", "layers": 12, "width": 768, "heads": 12, "vocab": 50257, "batch": 8, "seq": 512,
                   "desc": "GPT-2 small (124M), batch 8 x 512 tokens, bf16 autocast"},
}

#: engine -> variant -> the baseline it is compared with
VARIANTS: dict[str, dict[str, str]] = {
    "hf": {"clip": "clip", "none": "clip", "monitor": "clip", "default": "clip"},
    "lightning": {"clip": "clip", "none": "clip", "grad_norm_log": "clip", "monitor": "clip", "default": "clip"},
    "plain": {"clip": "clip", "none": "clip", "monitor": "clip", "default": "clip"},
}


def make_model(size: str) -> torch.nn.Module:
    s = SIZES[size]
    torch.manual_seed(0)
    if s["arch"] == "gpt2":
        from transformers import GPT2Config, GPT2LMHeadModel

        return GPT2LMHeadModel(GPT2Config(n_layer=s["layers"], n_embd=s["width"], n_head=s["heads"],
                                          vocab_size=s["vocab"], n_positions=max(1024, s["seq"])))
    from transformers import LlamaConfig, LlamaForCausalLM

    return LlamaForCausalLM(LlamaConfig(num_hidden_layers=s["layers"], hidden_size=s["width"],
                                        num_attention_heads=s["heads"], num_key_value_heads=s["heads"],
                                        intermediate_size=s["inter"], vocab_size=s["vocab"],
                                        max_position_embeddings=max(256, s["seq"])))


class Windows(torch.utils.data.Dataset):
    """Consecutive byte windows of real text (token ids < 256)."""

    def __init__(self, seq: int, n: int) -> None:
        data = load_corpus().long()
        self.seq, self.data, self.n = seq, data, min(n, len(data) // seq - 1)

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        x = self.data[i * self.seq:(i + 1) * self.seq]
        return {"input_ids": x, "labels": x}


class Baton:
    """Step-level interleaving of several engine runs in one process: each run is a thread, and only
    the holder of the baton runs. At every step end the holder passes the baton to the next run in a
    fixed order and waits for its next turn, so the runs advance one step each in turn and every
    slow or fast second of the machine is shared by all of them (run after run, the same model
    differs by several per cent from the machine alone; step by step the variants compare to a few
    tenths of a per cent)."""

    def __init__(self, names: list[str]) -> None:
        self.order = list(names)
        self.turn = {n: threading.Event() for n in names}
        self.left = set(names)
        self.lock = threading.Lock()

    def wait(self, name: str) -> None:
        self.turn[name].wait()
        self.turn[name].clear()

    def pass_on(self, name: str, finished: bool = False) -> None:
        with self.lock:
            if finished:
                self.left.discard(name)
            i = self.order.index(name)
            for k in range(1, len(self.order) + 1):
                nxt = self.order[(i + k) % len(self.order)]
                if nxt in self.left:
                    self.turn[nxt].set()
                    return


_SLOT = threading.local()  # the baton and the run's name in an interleaved run's thread


class StepClock:
    """Step-end times (and one step's CUDA sync count) for any engine; a full garbage collection
    before the steady-state clock starts, and the collections inside the window counted. In an
    interleaved run (see :class:`Baton`) the clock runs only while this run holds the baton: the
    times are the run's own active time (wall and process CPU time)."""

    def __init__(self, warm: int, cuda: bool) -> None:
        self.warm, self.cuda = warm, cuda
        self.times: list[float] = []
        self.cpu: list[float] = []  # process CPU time (every thread of the process) at each step end
        self.syncs: int | None = None
        self._catch: Any = None
        self._caught: list[Any] = []
        self.gc_ns = 0  # time in garbage collections inside the window
        self.gc_full = 0  # full (generation 2) collections inside the window
        self._gc_t0 = 0
        self._watching = False
        self.baton: Baton | None = getattr(_SLOT, "baton", None)
        self.name: str = getattr(_SLOT, "name", "")
        self.accounted_ns = 0  # time inside the accounted functions (see :func:`account`), steady window
        self._depth = 0
        _SLOT.clock = self
        self._wall = self._cpu = 0.0  # active time before the current turn
        self._t_wall, self._t_cpu = time.perf_counter(), time.process_time()  # the current turn's start

    def _on_gc(self, phase: str, info: dict[str, Any]) -> None:
        if not self._watching or (self.baton is not None and getattr(_SLOT, "name", None) != self.name):
            return  # another run's collection (gc callbacks run in the collecting thread)
        if phase == "start":
            self._gc_t0 = time.perf_counter_ns()
        else:
            self.gc_ns += time.perf_counter_ns() - self._gc_t0
            self.gc_full += info.get("generation") == 2

    def stop(self) -> None:
        """End of the run: stop watching the collector."""
        self._watching = False
        with contextlib.suppress(ValueError):
            gc.callbacks.remove(self._on_gc)

    def accounted_ms_per_step(self) -> float:
        return self.accounted_ns / 1e6 / max(1, len(self.times) - self.warm)

    def gc_ms_per_step(self) -> float:
        return self.gc_ns / 1e6 / max(1, len(self.times) - self.warm)

    def begin(self, step: int) -> None:
        """Before step ``step`` (1-based): the step after the warm-up is watched for CUDA syncs."""
        if self.cuda and step == self.warm + 1:
            self._catch = warnings.catch_warnings(record=True)
            self._caught = self._catch.__enter__()
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")

    def end(self, step: int) -> None:
        if self._catch is not None:
            torch.cuda.set_sync_debug_mode("default")
            self._catch.__exit__(None, None, None)
            self._catch = None
            self.syncs = sum("synchroniz" in str(w.message).lower() for w in self._caught)
        if self.cuda:
            torch.cuda.synchronize()
        if step == self.warm:  # every variant alike: the start-up garbage is not collected in the window
            gc.collect()
            gc.callbacks.append(self._on_gc)
            self._watching = True
        wall = self._wall + time.perf_counter() - self._t_wall
        cpu = self._cpu + time.process_time() - self._t_cpu
        self.times.append(wall)
        self.cpu.append(cpu)
        if self.baton is not None:  # the next run's turn; the clock stands still until ours comes back
            self._wall, self._cpu = wall, cpu
            self.baton.pass_on(self.name)
            self.baton.wait(self.name)
            self._t_wall, self._t_cpu = time.perf_counter(), time.process_time()

    def steady_ms(self) -> float:
        t = self.times[self.warm - 1:]
        return 1000 * (t[-1] - t[0]) / (len(t) - 1)

    def steps_ms(self) -> list[float]:
        """Wall time of every steady-state step (ms; active time in an interleaved run)."""
        t = self.times[self.warm - 1:]
        return [1000 * (b - a) for a, b in zip(t, t[1:])]

    def steady_cpu_ms(self) -> float:
        """CPU time of the whole process per steady-state step: the compute a step costs, without the
        time the process waited for a core (on a shared machine the wall time also measures the
        neighbours). Threads the engine or gradguard start are included."""
        t = self.cpu[self.warm - 1:]
        return 1000 * (t[-1] - t[0]) / (len(t) - 1)


_ACCOUNTED: set[tuple[int, str]] = set()


def account(owner: Any, name: str) -> None:
    """Count the time spent inside ``owner.name`` towards the running variant's accounted time
    (:attr:`StepClock.accounted_ns`), in the steady window only and outermost calls only (an
    accounted function calling another counts once). Installed once per process; a run's own
    thread-local clock says whose time it is, so interleaved runs do not mix."""
    if (id(owner), name) in _ACCOUNTED:
        return
    _ACCOUNTED.add((id(owner), name))
    fn = getattr(owner, name)
    if isinstance(owner, type) and isinstance(owner.__dict__.get(name), (staticmethod, classmethod)):
        raise TypeError(f"account: {owner.__name__}.{name} is a static/class method")

    def timed(*args: Any, **kwargs: Any) -> Any:
        clock = getattr(_SLOT, "clock", None)
        if clock is None or not clock._watching or clock._depth:
            return fn(*args, **kwargs)
        clock._depth += 1
        t0 = time.perf_counter_ns()
        try:
            return fn(*args, **kwargs)
        finally:
            clock.accounted_ns += time.perf_counter_ns() - t0
            clock._depth -= 1

    timed.__wrapped__ = fn  # type: ignore[attr-defined]
    setattr(owner, name, timed)


def _guard_cfg(preset: str, out_dir: str) -> gg.GuardConfig:
    return gg.GuardConfig.preset(preset, output={"dir": out_dir, "console": False})



def _result(clock: Any, core: Any) -> dict[str, Any]:
    """One engine run's numbers: steady step time, host syncs, GC in the window, guard transfers."""
    out: dict[str, Any] = {"step_ms": clock.steady_ms(), "cpu_ms": clock.steady_cpu_ms(), "syncs": clock.syncs,
                           "gc_ms_per_step": clock.gc_ms_per_step(), "gc_full": clock.gc_full,
                           "steps_ms": clock.steps_ms(), "accounted_ms": clock.accounted_ms_per_step()}
    if core is not None:
        out["guard_transfers_per_step"] = core.measurer.transfers / max(1, core.step_count)
    return out

def run_hf(variant: str, size: str, steps: int, warm: int, device: str, out_dir: str) -> dict[str, Any]:
    from transformers import Trainer, TrainerCallback, TrainingArguments

    from gradguard._hf.norm import StepDecision
    from gradguard.hf import GradGuardCallback

    s = SIZES[size]
    clock = StepClock(warm, device.startswith("cuda"))
    # accounted: the Trainer's norm pass (its clip) and everything the guard runs at the step boundary
    account(Trainer, "_clip_grad_norm")
    account(StepDecision, "engine_norm_pass")
    for hook in ("on_pre_optimizer_step", "on_step_begin", "on_step_end", "on_optimizer_step", "on_log",
                 "on_substep_end"):
        if hook in GradGuardCallback.__dict__:
            account(GradGuardCallback, hook)

    class Clock(TrainerCallback):
        def on_step_begin(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            clock.begin(state.global_step + 1)

        def on_step_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            clock.end(state.global_step)

    cbs: list[Any] = [Clock()]
    guard = None
    if variant in ("monitor", "default"):
        guard = GradGuardCallback(_guard_cfg(variant, out_dir))
        cbs.insert(0, guard)
    args = TrainingArguments(output_dir=out_dir, max_steps=steps, per_device_train_batch_size=s["batch"],
                             learning_rate=1e-4, logging_steps=10, save_strategy="no", report_to=[],
                             disable_tqdm=True, max_grad_norm=0.0 if variant == "none" else 1.0,
                             use_cpu=not device.startswith("cuda"), bf16=device.startswith("cuda"),
                             dataloader_num_workers=0, seed=0, data_seed=0)
    tr = Trainer(model=make_model(size), args=args, train_dataset=Windows(s["seq"], steps * s["batch"]),
                 callbacks=cbs)
    tr.train()
    clock.stop()
    return _result(clock, guard.core if guard is not None else None)


def run_lightning(variant: str, size: str, steps: int, warm: int, device: str, out_dir: str) -> dict[str, Any]:
    import lightning.pytorch as pl

    from gradguard._lightning.run import LightningRun
    from gradguard.lightning import GradGuardCallback

    s = SIZES[size]
    clock = StepClock(warm, device.startswith("cuda"))
    # accounted: Lightning's clip (replayed from the guard's pass in monitor mode) and the guard's hooks
    account(pl.LightningModule, "clip_gradients")
    for fn in ("batch_start", "observe_loss", "before_optimizer_step", "after_optimizer_step"):
        account(LightningRun, fn)

    class LM(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = make_model(size)

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            return self.model(input_ids=batch["input_ids"], labels=batch["labels"]).loss

        def configure_optimizers(self) -> Any:
            return torch.optim.AdamW(self.parameters(), lr=1e-4)

    class LMGradNormLog(LM):
        def on_before_optimizer_step(self, optimizer: Any) -> None:
            from lightning.pytorch.utilities import grad_norm

            self.log_dict(grad_norm(self, norm_type=2))

    class Clock(pl.Callback):
        def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
            clock.begin(trainer.global_step + 1)

        def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
            clock.end(trainer.global_step)

    cbs: list[Any] = [Clock()]
    guard = None
    if variant in ("monitor", "default"):
        guard = GradGuardCallback(_guard_cfg(variant, out_dir))
        cbs.insert(0, guard)
    cuda = device.startswith("cuda")
    trainer = pl.Trainer(accelerator="gpu" if cuda else "cpu", devices=1, max_steps=steps, callbacks=cbs,
                         logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, default_root_dir=out_dir, num_sanity_val_steps=0,
                         gradient_clip_val=None if variant == "none" else 1.0,
                         precision="bf16-mixed" if cuda else "32-true")
    module = LMGradNormLog() if variant == "grad_norm_log" else LM()
    loader = torch.utils.data.DataLoader(Windows(s["seq"], steps * s["batch"]), batch_size=s["batch"])
    trainer.fit(module, loader)
    clock.stop()
    return _result(clock, guard.core if guard is not None else None)


def run_plain(variant: str, size: str, steps: int, warm: int, device: str, out_dir: str) -> dict[str, Any]:
    s = SIZES[size]
    cuda = device.startswith("cuda")
    clock = StepClock(warm, cuda)
    model = make_model(size).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    params = list(model.parameters())
    cfg = _guard_cfg(variant, out_dir) if variant in ("monitor", "default") else None
    if variant == "monitor":  # the user's clip at 1.0, applied by the monitor guard from its one pass
        cfg = dataclasses.replace(cfg, clip=dataclasses.replace(cfg.clip, mode="fixed", max_norm=1.0))
    guard = gg.Guard(model, opt, config=cfg) if cfg is not None else None
    data = Windows(s["seq"], steps * s["batch"])
    loader = torch.utils.data.DataLoader(data, batch_size=s["batch"])

    def batches() -> Any:
        while True:  # epochs until the last step (the corpus may be shorter than steps x batch)
            yield from loader

    it = batches()
    amp = torch.autocast("cuda", dtype=torch.bfloat16) if cuda else contextlib.nullcontext()
    for step in range(1, steps + 1):
        clock.begin(step)
        batch = next(it)
        x = batch["input_ids"].to(device, non_blocking=True)
        with amp:
            loss = model(input_ids=x, labels=x).loss
        loss.backward()
        t0 = time.perf_counter_ns()  # accounted: the clip and the optimizer step, or guard.step (both)
        if variant == "clip":
            torch.nn.utils.clip_grad_norm_(params, 1.0)
        if guard is not None:
            guard.step(loss)
        else:
            opt.step()
        if clock._watching:
            clock.accounted_ns += time.perf_counter_ns() - t0
        opt.zero_grad(set_to_none=True)
        clock.end(step)
    clock.stop()
    out = _result(clock, guard.core if guard is not None else None)
    if guard is not None:
        guard.close()
    return out


RUNNERS: dict[str, Callable[..., dict[str, Any]]] = {"hf": run_hf, "lightning": run_lightning, "plain": run_plain}


def core_python_us(size: str, preset: str = "default", n: int = 300) -> dict[str, float]:
    """Microseconds per step of the core's own work beside the gradient pass: ``before_step`` +
    ``after_step`` (detectors, policy, clip decision, bookkeeping, amortised log-interval work)
    minus the measurement (``measurer.measure``) timed alone, on this size's model with fixed
    gradients on the CPU."""
    from gradguard.detect import Signals

    model = make_model(size)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    with tempfile.TemporaryDirectory(prefix="gg-core-") as d:
        core = gg.guard.GuardCore(model, opt, config=gg.GuardConfig.preset(
            preset, output={"dir": d, "console": False, "jsonl": False}))
        gen = torch.Generator().manual_seed(0)
        for p in model.parameters():
            p.grad = torch.randn(p.shape, generator=gen) * 1e-3
        loss = torch.tensor(2.0)

        def step() -> None:
            core.after_step(core.before_step(loss))

        def measure() -> None:
            core.measurer.measure([loss, None, None])

        meas = core.measurer.measure([2.0, None, None])

        def detect_policy() -> None:
            sig = Signals(step=core.step_count + 1, loss=2.0, total_norm=meas.total_norm,
                          layer_norms=dict(zip(core.layers.layer_names, meas.layer_norms)), nonfinite_layers=[],
                          scale=None, overflow=False)
            ratio = core.detectors.grad.ratio(meas.total_norm)
            core.policy.decide(sig, core.detectors.observe(sig), ratio, weights_verified=False)

        def timed(fn: Callable[[], None]) -> tuple[float, float]:
            """(median, mean) microseconds per call: the median is a plain step, the mean includes the
            periodic work (snapshots, log-interval parameter norms)."""
            for _ in range(max(10, n // 10)):
                fn()
            ts = []
            for _ in range(n):
                t0 = time.perf_counter()
                fn()
                ts.append((time.perf_counter() - t0) * 1e6)
            return statistics.median(ts), statistics.fmean(ts)

        (total, total_mean), (measured, measured_mean), (dp, _) = timed(step), timed(measure), timed(detect_policy)
        core.close()
    return {"layers": len(core.layers), "tensors": len(core.layers.params), "step_us": round(total, 1),
            "measure_us": round(measured, 1), "detect_policy_us": round(dp, 1),
            "core_python_us": round(max(0.0, total - measured), 1),
            # the mean includes the periodic work, and on a shared machine every preemption: noise-sensitive
            "core_python_mean_us": round(max(0.0, total_mean - measured_mean), 1)}


def _quiet_engines() -> None:
    import logging

    for name in ("lightning.pytorch", "lightning.fabric", "pytorch_lightning"):
        logging.getLogger(name).setLevel(logging.ERROR)
    with contextlib.suppress(ImportError):
        import transformers

        transformers.logging.set_verbosity_error()


def interleaved(engine: str, order: list[str], size: str, steps: int, warm: int, device: str,
                dirs: dict[str, str]) -> dict[str, dict[str, Any]]:
    """One round: every variant's run in its own thread, advancing one step each in turn
    (:class:`Baton`); only one thread runs at any time."""
    baton = Baton(order)
    out: dict[str, dict[str, Any]] = {}
    errors: list[BaseException] = []

    def one(v: str) -> None:
        _SLOT.baton, _SLOT.name = baton, v
        baton.wait(v)
        try:
            out[v] = RUNNERS[engine](v, size, steps, warm, device, dirs[v])
        except BaseException as exc:  # reported after the round; the others must go on
            errors.append(exc)
        finally:
            baton.pass_on(v, finished=True)

    threads = [threading.Thread(target=one, args=(v,), name=f"bench-{v}", daemon=True) for v in order]
    for t in threads:
        t.start()
    baton.turn[order[0]].set()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return out


def bench(engines: list[str], sizes: list[str], *, rounds: int, steps: int, warm: int, device: str,
          say: Callable[[str], None] | None = None, interleave: bool = True) -> dict[str, Any]:
    say = say or (lambda *a: print(*a, flush=True))
    _quiet_engines()
    out: dict[str, Any] = {"engines": {}, "rounds": rounds, "steps": steps, "warm": warm, "device": device,
                           "interleave": "step" if interleave else "run"}
    if interleave:  # warnings filters are process-wide: set once, not per thread
        warnings.simplefilter("ignore")
    with tempfile.TemporaryDirectory(prefix="gg-engines-") as tmp:
        for size in sizes:
            for engine in engines:
                names = list(VARIANTS[engine])
                runs: dict[str, list[dict[str, Any]]] = {v: [] for v in names}
                t0 = time.perf_counter()
                for r in range(rounds):
                    order = names[r % len(names):] + names[:r % len(names)]
                    dirs = {v: os.path.join(tmp, f"{engine}-{size}-{v}-{r}") for v in order}
                    for d in dirs.values():
                        os.makedirs(d, exist_ok=True)
                    if interleave:
                        got = interleaved(engine, order, size, steps, warm, device, dirs)
                    else:
                        with warnings.catch_warnings():
                            warnings.simplefilter("ignore")
                            got = {v: RUNNERS[engine](v, size, steps, warm, device, dirs[v]) for v in order}
                    for v in order:
                        runs[v].append(got[v])
                    say(f"  {engine}/{size}: round {r + 1}/{rounds} ({time.perf_counter() - t0:.0f}s)")
                rows = {}
                for v in names:
                    base = VARIANTS[engine][v]
                    ratios = [a["step_ms"] / b["step_ms"] for a, b in zip(runs[v], runs[base])]
                    cpu = [a["cpu_ms"] / b["cpu_ms"] for a, b in zip(runs[v], runs[base])]
                    rows[v] = {"vs": base, "ratio_median": statistics.median(ratios), "ratio_min": min(ratios),
                               "ratio_max": max(ratios), "ratios": ratios,
                               "cpu_ratio_median": statistics.median(cpu), "cpu_ratios": cpu,
                               "step_ms_median": statistics.median(x["step_ms"] for x in runs[v])}
                    # the accounted time's difference to the baseline's, per round, in % of the baseline step
                    added = [(a["accounted_ms"] - b["accounted_ms"]) / b["step_ms"]
                             for a, b in zip(runs[v], runs[base])]
                    rows[v]["accounted_ms_median"] = statistics.median(x["accounted_ms"] for x in runs[v])
                    rows[v]["added_median"], rows[v]["added_min"], rows[v]["added_max"] = (
                        statistics.median(added), min(added), max(added))
                    syncs = [x["syncs"] for x in runs[v] if x.get("syncs") is not None]
                    if syncs:
                        rows[v]["cuda_syncs_per_step"] = statistics.median(syncs)
                    tr = [x["guard_transfers_per_step"] for x in runs[v] if "guard_transfers_per_step" in x]
                    if tr:
                        rows[v]["guard_transfers_per_step"] = round(statistics.median(tr), 3)
                    if all("gc_ms_per_step" in x for x in runs[v]):
                        rows[v]["gc_ms_per_step"] = [round(x["gc_ms_per_step"], 3) for x in runs[v]]
                        rows[v]["gc_full"] = [x["gc_full"] for x in runs[v]]
                out["engines"].setdefault(engine, {})[size] = rows
    n_params = {s: sum(p.numel() for p in make_model(s).parameters()) for s in sizes}
    out["sizes"] = {s: {**SIZES[s], "params": n_params[s]} for s in sizes}
    out["core_python"] = {s: core_python_us(s) for s in sizes if not SIZES[s]["arch"] == "gpt2"}
    return out


def _pct(r: float) -> str:
    return f"{(r - 1) * 100:+.1f}%"


def table(doc: dict[str, Any]) -> str:
    eng = doc["engines_run"]
    sizes = list(eng["sizes"])
    head = ["engine", "variant", "vs"] + [f"{s} ({eng['sizes'][s]['params'] / 1e6:.2f}M params)" for s in sizes]
    cuda = eng["device"].startswith("cuda")
    if cuda:
        head.append("CUDA syncs per step")
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for engine, by_size in eng["engines"].items():
        for v in VARIANTS[engine]:
            cells = []
            syncs = []
            for s in sizes:
                r = by_size.get(s, {}).get(v)
                if r is None:
                    cells.append("-")
                    continue
                ms = f"{r['step_ms_median']:.1f} ms"
                if "accounted_ms_median" in r:
                    ms += f" (accounted {r['accounted_ms_median']:.2f} ms)"
                added = (f"; accounted {r['added_median'] * 100:+.2f}% [{r['added_min'] * 100:+.2f}, "
                         f"{r['added_max'] * 100:+.2f}]") if "added_median" in r else ""
                cells.append(ms if v == r["vs"] else
                             f"{_pct(r['ratio_median'])} [{_pct(r['ratio_min'])}, {_pct(r['ratio_max'])}]{added}")
                if "cuda_syncs_per_step" in r:
                    syncs.append(f"{r['cuda_syncs_per_step']:g}")
            row = [engine, f"`{v}`", "-" if v == VARIANTS[engine][v] else f"`{VARIANTS[engine][v]}`"] + cells
            if cuda:
                row.append("/".join(syncs) or "-")
            lines.append("| " + " | ".join(row) + " |")
    core = eng.get("core_python", {})
    core_txt = "; ".join(f"{s}: {c['core_python_us']:.0f} us per step beside the gradient pass (median step; "
                         "snapshots and log-interval work come every 50 steps) "
                         f"({c['layers']} layers, {c['tensors']} tensors; detectors + policy alone "
                         f"{c['detect_policy_us']:.0f} us; the fused pass {c['measure_us']:.0f} us on CPU)"
                         for s, c in core.items())
    env = doc["environment"]
    gc_note = (" A full garbage collection runs at step "
               f"{eng['warm']} in every variant (the engine's start-up garbage kept out of the window)."
               if any("gc_ms_per_step" in r for by in eng["engines"].values() for rows in by.values()
                      for r in rows.values()) else "")
    how = ("the variants of a round interleaved step by step in one process pinned to one core"
           if eng.get("interleave") == "step" else "interleaved rounds")
    lines += ["", f"Steady-state step time (step {eng['warm']} to {eng['steps']}, mean), {eng['rounds']} rounds, {how}; "
              "baselines in ms, the others as the median [min, max] of their per-round ratio to the `vs` run. "
              "*Accounted*: the time inside the functions where the variants differ (the engine's clip, the "
              "guard's hooks and the norm pass it takes over; the plain loop's clip + `optimizer.step()` or "
              "`guard.step()`), its difference to the baseline's in % of the baseline's step, median [min, max] "
              "over rounds: what the guard adds, without the +-1-3% a fresh model instance varies by; on "
              f"{eng['device']} ({env['threads']} threads, torch {env['torch']}, {env['date']}).{gc_note} Core work: "
              f"{core_txt or '-'}. Generated by `{doc['command']}`."]
    return "\n".join(lines) + "\n"
