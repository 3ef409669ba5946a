"""Overhead benchmark: step time of gradguard and of the monitors users would pick instead.

One command (CPU, ~5-10 minutes on 2 cores)::

    python benchmarks/overhead.py                 # demo model + a ~10x larger one, CPU
    python benchmarks/overhead.py --quick         # ~1-minute smoke run
    python benchmarks/overhead.py --device cuda   # GPU variant (skips with a message when no GPU)

Inside the engines (HF Trainer, Lightning, the plain loop; see ``benchmarks/engines.py``)::

    python benchmarks/overhead.py --engines hf,lightning,plain --threads 1        # CPU, small + large Llama
    python benchmarks/overhead.py --engines hf,lightning,plain --device cuda      # GPT-2 small, bf16, syncs

Every variant trains its own copy of the same model (same init, same batches) and the variants
are interleaved in one process: each repetition runs a block of steps of every variant in a
rotating order, so machine noise hits all of them alike. The ratio of a variant is the median over
repetitions of (its block time / the baseline's block time in the same repetition); the spread is
the 25th-75th percentile of those paired ratios; the amortised ratio is total time / baseline
total time (what snapshots cost on average).

Writes ``benchmarks/results/overhead-<date>-<machine>.{json,md}`` and, for the default CPU run,
``benchmarks/results/README_overhead_table.md``.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from common import RESULTS_DIR, environment, get_data, write_json  # noqa: E402

import gradguard  # noqa: E402
from gradguard.demo_model import TinyGPT  # noqa: E402

#: model name -> (constructor, batch size)
MODELS: dict[str, dict[str, Any]] = {
    "demo": {"make": lambda: TinyGPT(n_layer=2, width=128, n_head=4, seq_len=32), "batch": 64,
             "desc": "the demo model: TinyGPT 2 blocks, width 128, batch 64 x 32 bytes"},
    "large": {"make": lambda: TinyGPT(n_layer=6, width=256, n_head=8, seq_len=32), "batch": 16,
              "desc": "TinyGPT 6 blocks, width 256 (~10x the demo's parameters), batch 16 x 32 bytes"},
}

SNAPSHOT_INTERVALS = (10, 50, 200)


class Variant:
    """One way of doing the optimizer step, on its own copy of the model."""

    def __init__(self, name: str, group: str, desc: str, base: str) -> None:
        self.name, self.group, self.desc, self.base = name, group, desc, base
        self.times: list[float] = []
        self.steps = 0
        self.extra: dict[str, Any] = {}
        self.close: Callable[[], None] = lambda: None

    def setup(self, model: nn.Module, opt: torch.optim.Optimizer, out_dir: str) -> None:
        self.model, self.opt = model, opt

    def step(self, loss: torch.Tensor) -> None:
        raise NotImplementedError


def _plain(clip: float | None = None, monitor: Callable[[nn.Module], Any] | None = None) -> type[Variant]:
    class Plain(Variant):
        def step(self, loss: torch.Tensor) -> None:
            if monitor is not None:
                monitor(self.model)
            if clip is not None:
                torch.nn.utils.clip_grad_norm_(self.model.parameters(), clip)
            self.opt.step()

    return Plain


class GuardVariant(Variant):
    def __init__(self, name: str, group: str, desc: str, base: str, preset: str, **over: Any) -> None:
        super().__init__(name, group, desc, base)
        self.preset, self.over = preset, over

    def setup(self, model: nn.Module, opt: torch.optim.Optimizer, out_dir: str) -> None:
        super().setup(model, opt, out_dir)
        cfg = gradguard.GuardConfig.preset(self.preset, output={"dir": out_dir, "console": False}, **self.over)
        self.guard = gradguard.Guard(model, opt, config=cfg)
        self.close = self._close

    def step(self, loss: torch.Tensor) -> None:
        self.guard.step(loss)

    def _close(self) -> None:
        s = self.guard.close()
        self.extra["transfers_per_step"] = round(self.guard.core.measurer.transfers / max(1, s["steps"]), 3)
        self.extra["skipped"] = s["skipped"]
        self.extra["actions"] = s["actions"]
        snaps = []
        if s.get("log") and os.path.exists(s["log"]):
            with open(s["log"], encoding="utf-8") as fh:
                snaps = [e for e in map(json.loads, fh) if e.get("type") == "snapshot"]
        if snaps:
            self.extra["snapshots"] = len(snaps)
            self.extra["snapshot_bytes"] = snaps[-1]["bytes"]
            self.extra["snapshot_ms"] = round(1000 * statistics.median(e["seconds"] for e in snaps), 2)
            ring = getattr(self.guard.config.recovery, "ring_size", 2)
            self.extra["ring_bytes"] = snaps[-1]["bytes"] * ring


class LightningGradNorm(Variant):
    """Lightning's documented per-layer gradient monitor: ``grad_norm(model, norm_type=2)`` in
    ``on_before_optimizer_step``, logged every step (``self.log_dict`` turns each into a float)."""

    def step(self, loss: torch.Tensor) -> None:
        from lightning.pytorch.utilities import grad_norm

        norms = grad_norm(self.model, norm_type=2)
        self.logged = {k: float(v) for k, v in norms.items()}  # what log_dict does with them
        self.opt.step()


class ItemLoop(Variant):
    """Composer ``OptimizerMonitor`` style: the L2 norm of every parameter's gradient, each read
    back with ``.item()``, plus the total."""

    def step(self, loss: torch.Tensor) -> None:
        total = 0.0
        logged = {}
        for name, p in self.model.named_parameters():
            if p.grad is not None:
                v = p.grad.detach().norm(2).item()
                logged[f"l2_norm/grad/{name}"] = v
                total += v * v
        logged["l2_norm/grad/global"] = total ** 0.5
        self.logged = logged
        self.opt.step()


class WandbWatch(Variant):
    """``wandb.watch(model, log="gradients", log_freq=1)`` in offline mode, with the
    ``wandb.log`` per step that commits what the hooks collected."""

    def setup(self, model: nn.Module, opt: torch.optim.Optimizer, out_dir: str) -> None:
        super().setup(model, opt, out_dir)
        os.environ["WANDB_MODE"] = "offline"
        os.environ.setdefault("WANDB_SILENT", "true")
        import wandb

        self.wandb = wandb
        self.run = wandb.init(project="gradguard-overhead", dir=out_dir, mode="offline",
                              settings=wandb.Settings(silent=True, console="off"))
        wandb.watch(model, log="gradients", log_freq=1)
        self.close = self._close

    def step(self, loss: torch.Tensor) -> None:
        self.opt.step()
        self.wandb.log({"loss": float(loss.detach())})

    def _close(self) -> None:
        self.run.finish()


def variants(snapshot_intervals: tuple[int, ...] = SNAPSHOT_INTERVALS, wandb_ok: bool = True) -> list[Variant]:
    out: list[Variant] = [
        _plain()("unguarded", "baseline", "loss.backward(); optimizer.step()", "unguarded"),
        _plain(clip=1.0)("clip_grad_norm", "baseline", "clip_grad_norm_(1.0) + optimizer.step()", "unguarded"),
        GuardVariant("gradguard_monitor", "gradguard", "Guard(preset 'monitor'): per-layer norms, detectors, "
                     "no clipping", "unguarded", "monitor"),
        GuardVariant("gradguard_default", "gradguard", "Guard(GuardConfig()): owns clipping at 1.0, snapshots "
                     "every 50 steps, no fault", "unguarded", "default"),
        GuardVariant("gradguard_default_vs_clip", "gradguard", "the same Guard(GuardConfig()) vs clip_grad_norm_ "
                     "alone (gradguard owning clipping)", "clip_grad_norm", "default"),
        GuardVariant("gradguard_no_snapshots", "snapshot", "Guard(GuardConfig()), recovery.snapshot_interval=0",
                     "clip_grad_norm", "default", recovery={"snapshot_interval": 0}),
    ]
    for n in snapshot_intervals:
        out.append(GuardVariant(f"gradguard_snapshot_{n}", "snapshot", f"Guard(GuardConfig()), "
                                f"recovery.snapshot_interval={n}", "clip_grad_norm", "default",
                                recovery={"snapshot_interval": n}))
    out += [
        LightningGradNorm("lightning_grad_norm", "peer", "lightning.pytorch.utilities.grad_norm(model, 2) every "
                          "step, values read as floats (log_dict)", "unguarded"),
        ItemLoop("item_loop", "peer", "per-parameter grad.norm().item() loop (Composer OptimizerMonitor style)",
                 "unguarded"),
    ]
    if wandb_ok:
        out.append(WandbWatch("wandb_watch", "peer", "wandb.watch(model, log='gradients', log_freq=1), offline, "
                              "+ wandb.log per step", "unguarded"))
    return out


def count_cuda_syncs(fn: Callable[[], None]) -> int:
    """Synchronizing CUDA calls made by ``fn`` (torch.cuda.set_sync_debug_mode('warn'))."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return sum("synchroniz" in str(w.message).lower() for w in caught)


def bench_model(model_name: str, *, device: str, reps: int, block: int, warmup: int, seed: int = 0,
                snapshot_intervals: tuple[int, ...] = SNAPSHOT_INTERVALS, only: list[str] | None = None,
                say: Callable[[str], None] | None = None) -> dict[str, Any]:
    say = say or (lambda *a: print(*a, flush=True))
    spec = MODELS[model_name]
    torch.manual_seed(seed)
    base_model = spec["make"]().to(device)
    n_params = sum(p.numel() for p in base_model.parameters())
    data = get_data(32)
    gen = torch.Generator().manual_seed(seed)
    n_batches = 8
    batches = [tuple(t.to(device) for t in data.train_batch(spec["batch"], gen)) for _ in range(n_batches)]
    try:
        import wandb  # noqa: F401
        wandb_ok = True
    except ImportError:
        wandb_ok = False
    vs = variants(snapshot_intervals, wandb_ok)
    if only:
        keep = set(only) | {"unguarded", "clip_grad_norm"}
        vs = [v for v in vs if v.name in keep]
    tmp = tempfile.TemporaryDirectory(prefix="gg-overhead-")
    for i, v in enumerate(vs):
        m = copy.deepcopy(base_model)
        opt = torch.optim.AdamW(m.parameters(), lr=1e-4, weight_decay=0.01)
        d = os.path.join(tmp.name, f"v{i}")
        os.makedirs(d, exist_ok=True)
        v.setup(m, opt, d)
    cuda = device.startswith("cuda")

    def one(v: Variant, k: int) -> None:
        x, y = batches[k % n_batches]
        loss = v.model(x, y)
        loss.backward()
        v.step(loss)
        v.opt.zero_grad(set_to_none=True)
        v.steps += 1

    for v in vs:  # warm-up (allocator, first snapshot, lazy imports, wandb hooks)
        for k in range(warmup):
            one(v, k)
    if cuda:
        torch.cuda.synchronize()
        for v in vs:
            x, y = batches[0]

            def fn(v: Variant = v, x: torch.Tensor = x, y: torch.Tensor = y) -> None:
                loss = v.model(x, y)
                loss.backward()
                v.step(loss)
                v.opt.zero_grad(set_to_none=True)

            v.extra["cuda_syncs_per_step"] = count_cuda_syncs(fn)
            v.steps += 1
    t_start = time.perf_counter()
    for r in range(reps):
        order = vs[r % len(vs):] + vs[:r % len(vs)]  # rotate so no variant always runs first
        for v in order:
            if cuda:
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            for k in range(block):
                one(v, r * block + k)
            if cuda:
                torch.cuda.synchronize()
            v.times.append((time.perf_counter() - t0) / block)
        if (r + 1) % max(1, reps // 5) == 0:
            say(f"  {model_name}: repetition {r + 1}/{reps} ({time.perf_counter() - t_start:.0f}s)")
    for v in vs:
        try:
            v.close()
        except Exception as exc:  # a peer's teardown must not lose the timings
            v.extra["close_error"] = f"{type(exc).__name__}: {exc}"
    byname = {v.name: v for v in vs}
    rows = {}
    for v in vs:
        base = byname[v.base]
        ratios = sorted(a / b for a, b in zip(v.times, base.times))
        q = statistics.quantiles(ratios, n=4) if len(ratios) >= 2 else [ratios[0]] * 3
        rows[v.name] = {
            "group": v.group, "desc": v.desc, "vs": v.base, "ratio_median": statistics.median(ratios),
            "ratio_p25": q[0], "ratio_p75": q[2], "ratio_amortised": sum(v.times) / sum(base.times),
            "step_ms_median": 1000 * statistics.median(v.times), "blocks": len(v.times), "block_steps": block,
            **v.extra,
        }
        if v.name in ("lightning_grad_norm",):
            rows[v.name]["host_reads_per_step"] = sum(p.requires_grad for p in v.model.parameters()) + 1
        if v.name == "item_loop":
            rows[v.name]["host_reads_per_step"] = sum(p.requires_grad for p in v.model.parameters())
    tmp.cleanup()
    return {"model": model_name, "desc": spec["desc"], "params": n_params, "batch": spec["batch"],
            "device": device, "reps": reps, "block": block, "warmup": warmup, "variants": rows,
            "seconds": round(time.perf_counter() - t_start, 1)}


def _pct(r: float) -> str:
    return f"{(r - 1) * 100:+.1f}%"


def readme_table(doc: dict[str, Any]) -> str:
    models = doc["models"]
    names = list(models[0]["variants"])
    head = ["variant", "vs"] + [f"{m['model']} ({m['params'] / 1e6:.2f}M params)" for m in models] + [
        "host syncs per step (" + "/".join(m["model"] for m in models) + ")"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for n in names:
        if n in ("unguarded", "clip_grad_norm"):
            continue
        cells = []
        syncs = []
        for m in models:
            r = m["variants"].get(n)
            if r is None:
                cells.append("-")
                continue
            amort = ""
            if r["group"] == "snapshot":
                amort = f", amortised {_pct(r['ratio_amortised'])}"
                interval = int(n.rsplit("_", 1)[1]) if n.rsplit("_", 1)[1].isdigit() else 0
                base_ms = m["variants"][r["vs"]]["step_ms_median"]
                if interval and r.get("snapshot_ms") is not None and base_ms > 0:
                    amort += f", snapshot cost {r['snapshot_ms'] / interval / base_ms * 100:.2f}%/step"
            cells.append(f"{_pct(r['ratio_median'])} [{_pct(r['ratio_p25'])}, {_pct(r['ratio_p75'])}]{amort}")
            if "cuda_syncs_per_step" in r:
                syncs.append(f"{r['cuda_syncs_per_step']}")
            elif "transfers_per_step" in r:
                syncs.append(f"{r['transfers_per_step']:g}")
            elif "host_reads_per_step" in r:
                syncs.append(f"{r['host_reads_per_step']}")
        kind = ("CUDA syncs" if any("cuda_syncs_per_step" in m["variants"].get(n, {}) for m in models) else
                "guard transfers" if n.startswith("gradguard") else
                "per-parameter histograms, >= 1 each" if n == "wandb_watch" else ".item()/float reads")
        sync_cell = ("/".join(dict.fromkeys(syncs)) if syncs else "-") + f" ({kind})"
        vs = models[0]["variants"][n]["vs"]
        lines.append(f"| `{n}` | {vs} | " + " | ".join(cells) + f" | {sync_cell} |")
    snap = []
    for m in models:
        for r in m["variants"].values():
            if r.get("snapshot_bytes"):
                snap.append(f"{m['model']}: {r['snapshot_bytes'] / 2 ** 20:.1f} MiB per snapshot "
                            f"({r.get('snapshot_ms', 0):.1f} ms to take), {r['ring_bytes'] / 2 ** 20:.1f} MiB ring")
                break
    env = doc["environment"]
    lines += ["", f"Step-time overhead vs the `vs` run: median of paired per-repetition ratios [25th, 75th "
              f"percentile], interleaved in one process on {doc['device']} ({env['threads']} threads, torch "
              f"{env['torch']}, {env['date']}). Snapshot cost per step = ms to take one / interval / baseline step ms "
              "(the amortised ratio is too noisy to resolve it). Snapshot memory: " + ("; ".join(snap) or "-") + ". Generated by "
              "`python benchmarks/overhead.py`; details in `benchmarks/results/`."]
    return "\n".join(lines) + "\n"


def markdown(doc: dict[str, Any]) -> str:
    env = doc["environment"]
    out = [f"# Overhead benchmark ({env['date']})", "",
           f"Command: `{doc['command']}`. Machine: {env['platform']}, {env['cpu_count']} CPUs, {env['threads']} torch "
           f"threads, torch {env['torch']}, device {doc['device']}, gradguard at {env.get('git_commit', '?')}"
           f"{' + uncommitted core changes' if env.get('gradguard_uncommitted_changes') else ''}. Total {doc['seconds'] / 60:.1f} min.", "",
           readme_table(doc), ""]
    for m in doc["models"]:
        out += [f"## {m['model']}: {m['desc']} ({m['params']:,} parameters)", "",
                f"{m['reps']} repetitions x {m['block']} steps per variant after {m['warmup']} warm-up steps.", "",
                "| variant | what | vs | median step | ratio (median) | p25 | p75 | amortised | extra |",
                "|" + "---|" * 9]
        for n, r in m["variants"].items():
            extra = {k: v for k, v in r.items() if k not in (
                "group", "desc", "vs", "ratio_median", "ratio_p25", "ratio_p75", "ratio_amortised", "step_ms_median",
                "blocks", "block_steps")}
            out.append(f"| `{n}` | {r['desc']} | {r['vs']} | {r['step_ms_median']:.1f} ms | {r['ratio_median']:.3f} | "
                       f"{r['ratio_p25']:.3f} | {r['ratio_p75']:.3f} | {r['ratio_amortised']:.3f} | "
                       f"{', '.join(f'{k}={v}' for k, v in extra.items()) or '-'} |")
        out.append("")
    out.append("Host syncs: on the CPU, `transfers_per_step` counts the guard's own host-device transfers "
               "(`guard.core.measurer.transfers`); the peers' counts are their `.item()`/float reads per step. On CUDA "
               "(`--device cuda`), `cuda_syncs_per_step` counts synchronizing calls flagged by "
               "`torch.cuda.set_sync_debug_mode('warn')` over one full step (forward, backward, monitor, optimizer).")
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> dict[str, Any] | None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cpu", help="cpu (default) or cuda")
    ap.add_argument("--quick", action="store_true", help="~1-minute smoke run (demo model, few repetitions)")
    ap.add_argument("--models", help="comma-separated: demo,large (default both; --quick: demo)")
    ap.add_argument("--reps", type=int, help="repetitions (default 20 demo / 10 large; --quick 4)")
    ap.add_argument("--block", type=int, help="steps per block (default 2; --quick 2)")
    ap.add_argument("--warmup", type=int, default=None, help="warm-up steps per variant (default 5)")
    ap.add_argument("--variants", help="comma-separated subset of variants (baselines always run)")
    ap.add_argument("--threads", type=int, default=2, help="torch CPU threads (default 2)")
    ap.add_argument("--out", default=RESULTS_DIR, help="results folder")
    ap.add_argument("--engines", help="comma-separated engines (hf, lightning, plain): measure inside the engines "
                                      "instead of the plain-loop variants (benchmarks/engines.py)")
    ap.add_argument("--sizes", help="with --engines: comma-separated model sizes (default small,large; cuda: "
                                    "gpt2-small)")
    ap.add_argument("--rounds", type=int, help="with --engines: interleaved rounds (default 7; --quick 2)")
    ap.add_argument("--steps", type=int, help="with --engines: optimizer steps per run (default 60; --quick 20)")
    ap.add_argument("--warm", type=int, help="with --engines: steps before the steady state (default 10; --quick 5)")
    ap.add_argument("--tag", help="with --engines: a suffix for the results files "
                                  "(overhead-engines-<date>-<machine>-<tag>.{json,md}), so a partial run keeps the full one")
    ap.add_argument("--from-json", metavar="JSON", help="rebuild the Markdown and README table of an existing "
                                                       "results JSON (no measuring)")
    args = ap.parse_args(argv)
    if args.engines and not args.from_json:
        return main_engines(args, argv)
    if args.from_json:
        with open(args.from_json, encoding="utf-8") as fh:
            doc = json.load(fh)
        if "engines_run" in doc:
            return _write_engines(doc, os.path.dirname(args.from_json), os.path.basename(args.from_json)[:-5])
        with open(args.from_json[:-len(".json")] + ".md", "w", encoding="utf-8") as fh:
            fh.write(markdown(doc))
        table = readme_table(doc)
        print(table)
        custom = ("--quick", "--variants", "--models", "--reps", "--block")
        if not any(flag in doc.get("command", "--quick") for flag in custom):
            name = "README_overhead_table.md" if doc["device"] == "cpu" else "README_overhead_table_cuda.md"
            with open(os.path.join(os.path.dirname(args.from_json), name), "w", encoding="utf-8") as fh:
                fh.write(table)
        return doc
    torch.set_num_threads(args.threads)
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print("overhead: --device cuda requested but no CUDA device is available; skipped (nothing written).")
        return None
    models = args.models.split(",") if args.models else (["demo"] if args.quick else list(MODELS))
    defaults = {"demo": (20, 2), "large": (10, 2)}
    if args.device.startswith("cuda"):
        defaults = {"demo": (50, 10), "large": (30, 10)}
    res = []
    t0 = time.perf_counter()
    for m in models:
        reps, block = defaults.get(m, (12, 3))
        if args.quick:
            reps, block = 4, 2
        reps = args.reps or reps
        block = args.block or block
        warm = args.warmup if args.warmup is not None else (2 if args.quick else 5)
        print(f"{m}: {MODELS[m]['desc']}; {reps} repetitions x {block} steps")
        res.append(bench_model(m, device=args.device, reps=reps, block=block, warmup=warm,
                               only=args.variants.split(",") if args.variants else None))
    env = environment()
    tag = ("cuda" + (torch.cuda.get_device_name(0).split()[-1].lower() if args.device.startswith("cuda") else "")
           if args.device.startswith("cuda") else f"cpu{torch.get_num_threads()}")
    doc = {"benchmark": "overhead", "command": "python benchmarks/overhead.py " + " ".join(sys.argv[1:] if argv is None
                                                                                           else argv),
           "device": args.device, "environment": env, "models": res, "seconds": round(time.perf_counter() - t0, 1)}
    doc["command"] = doc["command"].strip()
    stem = f"overhead-{time.strftime('%Y-%m-%d')}-{tag}" + ("-quick" if args.quick else "")
    write_json(os.path.join(args.out, stem + ".json"), doc)
    with open(os.path.join(args.out, stem + ".md"), "w", encoding="utf-8") as fh:
        fh.write(markdown(doc))
    table = readme_table(doc)
    print(table)
    print(f"results: {os.path.join(args.out, stem)}.{{md,json}}")
    if not args.quick and not args.variants and not args.models and not args.reps and not args.block:
        name = "README_overhead_table.md" if args.device == "cpu" else f"README_overhead_table_{tag}.md"
        with open(os.path.join(args.out, name), "w", encoding="utf-8") as fh:
            fh.write(table)
        print(f"README table: {os.path.join(args.out, name)}")
    return doc


def main_engines(args: argparse.Namespace, argv: list[str] | None) -> dict[str, Any] | None:
    import engines

    torch.set_num_threads(args.threads)
    cuda = args.device.startswith("cuda")
    if cuda and not torch.cuda.is_available():
        print("overhead: --device cuda requested but no CUDA device is available; skipped (nothing written).")
        return None
    names = args.engines.split(",")
    unknown = [e for e in names if e not in engines.RUNNERS]
    if unknown:
        raise SystemExit(f"overhead: --engines {unknown}: unknown; choose from {sorted(engines.RUNNERS)}")
    sizes = args.sizes.split(",") if args.sizes else (["gpt2-small"] if cuda else ["small", "large"])
    rounds = args.rounds or (2 if args.quick else 7)
    steps = args.steps or (20 if args.quick else 60)
    warm = args.warm or (5 if args.quick else 10)
    pinned = None
    if not cuda and hasattr(os, "sched_setaffinity") and len(os.sched_getaffinity(0)) > 1:
        pinned = max(os.sched_getaffinity(0))  # one core: the interleaved runs never migrate between steps
        os.sched_setaffinity(0, {pinned})
    t0 = time.perf_counter()
    run = engines.bench(names, sizes, rounds=rounds, steps=steps, warm=warm, device=args.device)
    run["pinned_cpu"] = pinned
    tag = ("cuda-" + torch.cuda.get_device_name(0).split()[-1].lower()) if cuda else f"cpu{torch.get_num_threads()}"
    command = "python benchmarks/overhead.py " + " ".join(sys.argv[1:] if argv is None else argv)
    doc = {"benchmark": "overhead-engines", "command": command.strip(), "device": args.device,
           "environment": environment(), "engines_run": run, "seconds": round(time.perf_counter() - t0, 1)}
    stem = f"overhead-engines-{time.strftime('%Y-%m-%d')}-{tag}" + ("-quick" if args.quick else "") \
        + (f"-{args.tag}" if args.tag else "")
    write_json(os.path.join(args.out, stem + ".json"), doc)
    return _write_engines(doc, args.out, stem)


def _write_engines(doc: dict[str, Any], out: str, stem: str) -> dict[str, Any]:
    import engines

    table = engines.table(doc)
    env = doc["environment"]
    md = [f"# Overhead inside the engines ({env['date']})", "",
          f"Command: `{doc['command']}`. Machine: {env['platform']}, {env['cpu_count']} CPUs, {env['threads']} torch "
          f"threads, torch {env['torch']}, gradguard at {env.get('git_commit', '?')}. Total {doc['seconds'] / 60:.1f} min.",
          "", table, "", "Per-round ratios:", ""]
    for engine, by_size in doc["engines_run"]["engines"].items():
        for size, rows in by_size.items():
            for v, r in rows.items():
                md.append(f"- {engine}/{size}/`{v}` vs `{r['vs']}`: " + ", ".join(f"{x:.3f}" for x in r["ratios"])
                          + f" (median step {r['step_ms_median']:.1f} ms"
                          + (f", guard transfers/step {r['guard_transfers_per_step']:g}"
                             if "guard_transfers_per_step" in r else "")
                          + (f", CUDA syncs/step {r['cuda_syncs_per_step']:g}" if "cuda_syncs_per_step" in r else "")
                          + (", GC in the window " + ", ".join(f"{g:.2f}" for g in r["gc_ms_per_step"]) + " ms/step ("
                             + "/".join(str(n) for n in r["gc_full"]) + " full)" if "gc_ms_per_step" in r else "")
                          + ")")
    with open(os.path.join(out, stem + ".md"), "w", encoding="utf-8") as fh:
        fh.write("\n".join(md) + "\n")
    print(table)
    print(f"results: {os.path.join(out, stem)}.{{md,json}}")
    custom = ("--quick", "--sizes", "--rounds", "--steps", "--warm", "--tag")
    if not any(flag in doc["command"] for flag in custom) and set(doc["engines_run"]["engines"]) == {
            "hf", "lightning", "plain"}:
        name = "README_overhead_engines_table.md" if doc["device"] == "cpu" else "README_overhead_engines_table_cuda.md"
        with open(os.path.join(out, name), "w", encoding="utf-8") as fh:
            fh.write(table)
        print(f"README table: {os.path.join(out, name)}")
    return doc


if __name__ == "__main__":
    main()
