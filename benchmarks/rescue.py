"""Rescue benchmark: does a run that would have blown up finish near the well-tuned loss?

One command (default suite, CPU, ~20-30 minutes on 2 cores)::

    python benchmarks/rescue.py                 # all scenarios x arms x models, seeds 0,1
    python benchmarks/rescue.py --quick         # ~3-minute smoke run (short runs, one seed, GPT only)
    python benchmarks/rescue.py --seeds 0,1 --scenarios explosive,nan --arms unguarded,gradguard_default

Writes ``benchmarks/results/rescue-<date>-<machine>.{json,md}`` and, for the default suite,
``benchmarks/results/README_rescue_table.md`` (the summary table pasted into the README).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from collections import Counter, defaultdict
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from common import (  # noqa: E402
    ALL_ARMS,
    ARMS,
    DIVERGED_RATIO,
    EXTRA_ARMS,
    MAX_SKIP_FRAC,
    MODELS,
    RESCUE_RATIO,
    RESULTS_DIR,
    as_dict,
    environment,
    machine_tag,
    oracle_of,
    run_one,
    scenarios,
    score,
    write_json,
)

DEFAULT_SEEDS = (0, 1)
ARM_ORDER = list(ARMS)


def _seeds_for(sc: Any, seeds: list[int]) -> list[int]:
    """The seeds a scenario runs: those asked for, plus 0..min_seeds-1."""
    return sorted(set(seeds) | set(range(sc.min_seeds)))


def _kinds(scs: dict[str, Any]) -> dict[str, str]:
    """Scenario name -> 'fault' | 'quiet' | 'healthy' (older result files: 'stable' is healthy)."""
    out = {}
    for name, sc in scs.items():
        kind = sc.get("kind") if isinstance(sc, dict) else getattr(sc, "kind", None)
        out[name] = kind or ("healthy" if name == "stable" else "fault")
    return out


def criterion_text() -> str:
    return (f"**Rescued**: the run finished (not stopped or halted), its final eval loss is finite and within "
            f"{(RESCUE_RATIO - 1) * 100:.0f}% of the tuned oracle's (same model, seed, precision and length; the "
            "fault-free base run without clipping ends up to ~5% above it), and at "
            f"most {MAX_SKIP_FRAC:.0%} of its steps were skipped outside the fault window. **Diverged**: eval loss "
            f"non-finite or above {DIVERGED_RATIO:g} x the oracle's. Rescue rate = rescued runs / runs, over models "
            "and seeds; *overall* pools the fault scenarios, loud and quiet (the healthy runs are scored separately: a "
            "guard must leave them alone; *vs unguarded* is the worst (highest) ratio of a healthy run's eval loss to "
            "the unguarded run's of the same model, seed and scenario, minus 1: negative means better).")


def run_suite(*, models: list[str], scenario_names: list[str], arms: list[str], seeds: list[int],
              quick: bool = False, say: Any = None, checkpoint: Any = None) -> dict[str, Any]:
    """Run the grid; returns the results document (runs with scores, summary, environment).
    ``checkpoint(doc)`` is called with the partial document after every scenario's arms."""
    say = say or (lambda *a: print(*a, flush=True))
    scs = scenarios(quick)
    unknown = [s for s in scenario_names if s not in scs] + [a for a in arms if a not in ALL_ARMS] + [
        m for m in models if m not in MODELS]
    if unknown:
        raise SystemExit(f"unknown scenario/arm/model: {unknown}. Scenarios: {list(scs)}; arms: {list(ALL_ARMS)}; "
                         f"models: {list(MODELS)}")
    runs: list[dict[str, Any]] = []
    oracles: dict[tuple, dict[str, Any]] = {}
    done = 0
    t_start = time.perf_counter()
    def cost(name: str) -> float:  # cheap scenarios first: a partial run still covers most of the grid
        sc = scs[name]
        return sc.steps * sc.batch * sc.width ** 2 * (8 if sc.fp16 else 1)

    all_seeds = sorted(set(seeds) | {i for n in scenario_names for i in range(scs[n].min_seeds)})
    total = sum(len(arms) * len(models) * len(_seeds_for(scs[n], seeds)) for n in scenario_names)
    for seed in all_seeds:
        for model in models:
            for name in sorted(scenario_names, key=cost):
                sc = scs[name]
                if seed not in _seeds_for(sc, seeds):
                    continue
                osc = oracle_of(sc)
                key = (model, seed, osc.steps, osc.batch, osc.fp16, osc.width, osc.pre_steps)
                if key not in oracles:
                    oracles[key] = run_one(model, osc, "oracle", seed)
                    say(f"  oracle {model} seed {seed} steps {osc.steps} batch {osc.batch} width {osc.width}"
                        f"{' fp16' if osc.fp16 else ''}: "
                        f"eval {oracles[key]['eval_loss']}")
                orc = oracles[key]
                for arm in arms:
                    rec = run_one(model, sc, arm, seed)
                    rec.update(score(rec, orc["eval_loss"]))
                    runs.append(rec)
                    done += 1
                    gap = "-" if rec["gap"] is None else f"{rec['gap'] * 100:+.1f}%"
                    say(f"[{done}/{total} {time.perf_counter() - t_start:.0f}s] {model} {name} {arm} seed {seed}: "
                        f"eval {rec['eval_loss'] if rec['eval_loss'] is None else round(rec['eval_loss'], 3)} "
                        f"({gap}) {'rescued' if rec['rescued'] else 'NOT rescued'} skipped {rec['skipped']} "
                        f"alarms {rec['alarms']}{' stopped@' + str(rec['stopped_at']) if rec['stopped_at'] else ''}"
                        f"{' ' + str(rec.get('guard_actions')) if rec.get('guard_actions') else ''}")
                if checkpoint is not None and done < total:
                    checkpoint(_document(runs, oracles, quick, models, seeds, scs, scenario_names, arms, t_start,
                                         done, total))
    return _document(runs, oracles, quick, models, seeds, scs, scenario_names, arms, t_start, done, total)


def _document(runs: list[dict[str, Any]], oracles: dict[tuple, dict[str, Any]], quick: bool, models: list[str],
              seeds: list[int], scs: dict[str, Any], scenario_names: list[str], arms: list[str], t_start: float,
              done: int, total: int) -> dict[str, Any]:
    oracle_runs = [dict(r, key=list(k)) for k, r in oracles.items()]
    doc = {"complete": done == total, "runs_done": done, "runs_total": total,"benchmark": "rescue", "quick": quick, "environment": environment(), "criterion": criterion_text(),
           "rescue_ratio": RESCUE_RATIO, "diverged_ratio": DIVERGED_RATIO, "max_skip_frac": MAX_SKIP_FRAC,
           "models": {m: MODELS[m]["desc"] for m in models}, "seeds": seeds,
           "scenarios": {n: as_dict(scs[n]) for n in scenario_names},
           "arms": {a: (ALL_ARMS[a]().desc) for a in arms}, "oracle_runs": oracle_runs, "runs": runs,
           "seconds": round(time.perf_counter() - t_start, 1)}
    doc["summary"] = summarize(runs, doc["scenarios"], arms)
    return doc


def _mean(xs: list[float]) -> float | None:
    xs = [x for x in xs if x is not None and math.isfinite(x)]
    return statistics.fmean(xs) if xs else None


def summarize(runs: list[dict[str, Any]], scenarios: dict[str, Any], arms: list[str]) -> dict[str, Any]:
    by: dict[tuple[str, str], list[dict[str, Any]]] = defaultdict(list)
    for r in runs:
        by[(r["arm"], r["scenario"])].append(r)
    kinds = _kinds(scenarios)
    unguarded = {(r["model"], r["seed"], r["scenario"]): r["eval_loss"] for r in runs if r["arm"] == "unguarded"}
    out: dict[str, Any] = {"rate": {}, "overall": {}, "false_alarms": {}, "healthy": {}, "vs_unguarded": {},
                           "cells": {}}
    for arm in arms:
        out["rate"][arm] = {}
        n_all = ok_all = 0
        healthy: list[dict[str, Any]] = []
        for s in scenarios:
            rs = by.get((arm, s), [])
            if not rs:
                continue
            ok = sum(r["rescued"] for r in rs)
            out["rate"][arm][s] = [ok, len(rs)]
            if kinds[s] == "healthy":
                healthy.extend(rs)
            else:
                n_all += len(rs)
                ok_all += ok
            acts: Counter[str] = Counter()
            for r in rs:
                acts.update(r.get("guard_actions") or {})
            out["cells"][f"{arm}|{s}"] = {
                "n": len(rs), "rescued": ok, "diverged": sum(r["diverged"] for r in rs),
                "eval_loss": _mean([r["eval_loss"] for r in rs]), "gap": _mean([r["gap"] for r in rs]),
                "skipped": _mean([r["skipped"] for r in rs]), "steps_lost": _mean([r["steps_lost"] for r in rs]),
                "time_lost_s": _mean([r["time_lost_s"] for r in rs]), "alarms": _mean([r["alarms"] for r in rs]),
                "stopped": sum(r["stopped_at"] is not None for r in rs),
                "actions": {k: round(v / len(rs), 2) for k, v in sorted(acts.items())},
                "seconds": _mean([r["seconds"] for r in rs]),
            }
        if n_all:
            out["overall"][arm] = [ok_all, n_all]
        if healthy:
            out["false_alarms"][arm] = _mean([r["alarms"] for r in healthy])
            out["healthy"][arm] = [sum(r["rescued"] for r in healthy), len(healthy)]
            gaps = [r["eval_loss"] / unguarded[k] - 1 for r in healthy
                    if r["eval_loss"] is not None and unguarded.get(k := (r["model"], r["seed"], r["scenario"]))]
            out["vs_unguarded"][arm] = max(gaps) if gaps else None
    return out


def _rate(v: list[int] | None) -> str:
    if not v:
        return "-"
    ok, n = v
    return f"{ok}/{n} ({ok / n:.0%})"


def readme_table(doc: dict[str, Any]) -> str:
    s = doc["summary"]
    kinds = _kinds(doc["scenarios"])
    faults = [n for n, k in kinds.items() if k != "healthy"]
    healthy = [n for n, k in kinds.items() if k == "healthy"]
    head = ["arm"] + [f"{n} (quiet)" if kinds[n] == "quiet" else n for n in faults] + (
        ["**overall**"] if faults else []) + (
        [f"healthy ({len(healthy)} scenarios): kept / false alarms per run / worst vs unguarded"] if healthy else [])
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for arm in doc["arms"]:
        row = [f"`{arm}`"] + [_rate(s["rate"][arm].get(n)) for n in faults]
        if faults:
            row.append(f"**{_rate(s['overall'].get(arm))}**")
        if healthy:
            fa = s["false_alarms"].get(arm)
            vs = (s.get("vs_unguarded") or {}).get(arm)
            kept = s.get("healthy", {}).get(arm) or s["rate"][arm].get("stable")
            row.append(f"{_rate(kept)} / {'-' if fa is None else f'{fa:.2f}'} / "
                       f"{'-' if vs is None else f'{vs * 100:+.1f}%'}")
        lines.append("| " + " | ".join(row) + " |")
    env = doc["environment"]
    lines.append("")
    lines.append(f"Rescue rate (rescued runs / runs) over models {', '.join(doc['models'])} and seeds "
                 f"{', '.join(map(str, doc['seeds']))} (the quiet scenario: 4 seeds); healthy scenarios: "
                 f"{', '.join(healthy)}; {env['date']}, torch {env['torch']}, {env['threads']} CPU "
                 f"threads, {doc['seconds'] / 60:.0f} min. {doc['criterion']} Generated by "
                 "`python benchmarks/rescue.py`; details in `benchmarks/results/`.")
    return "\n".join(lines) + "\n"


def _fmt(v: float | None, spec: str, pct: bool = False) -> str:
    if v is None:
        return "-"
    return format(v * 100 if pct else v, spec) + ("%" if pct else "")


def markdown(doc: dict[str, Any]) -> str:
    s = doc["summary"]
    env = doc["environment"]
    out = [f"# Rescue benchmark ({env['date']})", "",
           f"Command: `{doc.get('command', 'python benchmarks/rescue.py')}` (seeds "
           f"{', '.join(map(str, doc['seeds']))}). Machine: {env['platform']}, {env['cpu_count']} CPUs, "
           f"{env['threads']} torch threads, torch {env['torch']}, Python {env['python']}, gradguard at "
           f"{env.get('git_commit', '?')}{' + uncommitted core changes' if env.get('gradguard_uncommitted_changes') else ''}. "
           f"Total {doc['seconds'] / 60:.1f} min." + ("" if doc.get("complete", True) else
                                                       f" **INCOMPLETE: {doc['runs_done']}/{doc['runs_total']} runs "
                                                       "done (partial results, written while the suite runs).**"),
           "", doc["criterion"], "", "## Rescue rate", "",
           readme_table(doc).split("\n\n")[0], "", "## Scenarios", ""]
    for n, sc in doc["scenarios"].items():
        out.append(f"- `{n}`: {sc['desc']} ({sc['steps']} steps, batch {sc['batch']} x {sc['seq_len']} bytes, "
                   f"width {sc['width']}{', fp16' if sc['fp16'] else ''}"
                   f"{', user clip ' + format(sc['clip'], 'g') if sc.get('clip') else ''}).")
    out += ["", "Models: " + "; ".join(f"`{k}`: {v}" for k, v in doc["models"].items()) + ".", "", "## Arms", ""]
    out += [f"- `{a}`: {d}" for a, d in doc["arms"].items()]
    out += ["- `oracle` (target): tuned lr 3e-3, 20 warm-up steps, clip 1.0, no fault.", "",
            "## Per scenario and arm (means over models and seeds)", "",
            "| scenario | arm | rescued | diverged | eval loss | gap to oracle | skipped | steps lost | time lost | "
            "alarms | stopped | gradguard actions per run |", "|" + "---|" * 12]
    for n in doc["scenarios"]:
        for arm in doc["arms"]:
            c = s["cells"].get(f"{arm}|{n}")
            if not c:
                continue
            acts = ", ".join(f"{k} {v:g}" for k, v in c["actions"].items()) or "-"
            out.append(f"| {n} | `{arm}` | {c['rescued']}/{c['n']} | {c['diverged']}/{c['n']} | "
                       f"{_fmt(c['eval_loss'], '.3f')} | {_fmt(c['gap'], '+.1f', True)} | {_fmt(c['skipped'], '.1f')} | "
                       f"{_fmt(c['steps_lost'], '.1f')} | {_fmt(c['time_lost_s'], '.2f')}s | {_fmt(c['alarms'], '.1f')} | "
                       f"{c['stopped']} | {acts} |")
    out += ["", "Steps lost = skipped steps + steps undone by rollbacks + steps not run after a stop; time lost = "
            "steps lost x the run's mean step time. Alarms = steps on which the arm flagged something (gradguard: a "
            "warning/critical finding; ZClip: a z-score clip; OLMo: a skip; KillLossSpike: an outlier).", "",
            "## gradguard event excerpts (default preset, seed of each first run)", ""]
    seen = set()
    for r in doc["runs"]:
        if r["arm"] != "gradguard_default" or (r["model"], r["scenario"]) in seen:
            continue
        seen.add((r["model"], r["scenario"]))
        evs = "; ".join(
            f"{e['step']}: {e.get('finding') or e.get('action')}"
            + (f" {_short(e['params'])}" if e.get("params") else "") for e in r.get("events", [])[:10]) or "none"
        gap = "-" if r["gap"] is None else f"{r['gap'] * 100:+.1f}%"
        out.append(f"- {r['model']} / {r['scenario']} (seed {r['seed']}, gap {gap}, "
                   f"{'rescued' if r['rescued'] else 'not rescued'}): {evs}")
    oc = ", ".join(f"{r['model']} seed {r['seed']} {r['steps']} steps batch {r['key'][3]} width {r['key'][5]}"
                   f"{' fp16' if r['key'][4] else ''}: "
                   f"{r['eval_loss']:.3f}" for r in doc["oracle_runs"])
    out += ["", f"Oracle eval losses: {oc}.", "", "Raw per-run records (loss curves, events): the JSON file beside "
            "this one."]
    return "\n".join(out) + "\n"


def _short(params: dict[str, Any]) -> str:
    return "(" + ", ".join(f"{k}={round(v, 4) if isinstance(v, float) else v}" for k, v in params.items()) + ")"


def rescore(path: str, readme: bool = True) -> dict[str, Any]:
    """Re-apply the current rescue criterion to a finished results JSON (no training)."""
    with open(path, encoding="utf-8") as fh:
        doc = json.load(fh)
    for r in doc["runs"]:
        r.update(score(r, r["oracle_loss"]))
    doc["criterion"] = criterion_text()
    doc["rescue_ratio"], doc["diverged_ratio"], doc["max_skip_frac"] = RESCUE_RATIO, DIVERGED_RATIO, MAX_SKIP_FRAC
    doc["summary"] = summarize(doc["runs"], doc["scenarios"], list(doc["arms"]))
    doc["rescored"] = time.strftime("%Y-%m-%d %H:%M:%S")
    write_json(path, doc)
    with open(path[:-len(".json")] + ".md", "w", encoding="utf-8") as fh:
        fh.write(markdown(doc))
    print(readme_table(doc))
    if readme and doc.get("complete", True) and not doc.get("quick"):
        out = os.path.join(os.path.dirname(path), "README_rescue_table.md")
        with open(out, "w", encoding="utf-8") as fh:
            fh.write(readme_table(doc))
        print(f"README table: {out}")
    return doc


def merge(paths: list[str], out_dir: str) -> dict[str, Any]:
    """One results document from several (a suite run in parts, or new scenarios next to an
    earlier full run): a later file's run replaces an earlier one of the same model, scenario, arm
    and seed. Writes ``rescue-<date>-<machine>-merged.{json,md}`` and the README table."""
    docs = []
    for path in paths:
        with open(path, encoding="utf-8") as fh:
            docs.append(json.load(fh))
    runs: dict[tuple, dict[str, Any]] = {}
    oracles: dict[tuple, dict[str, Any]] = {}
    scs: dict[str, Any] = {}
    arms: dict[str, str] = {}
    models: dict[str, str] = {}
    for d in docs:
        for r in d["runs"]:
            runs[(r["model"], r["scenario"], r["arm"], r["seed"])] = r
        for r in d["oracle_runs"]:
            oracles[tuple(r["key"])] = r
        scs.update(d["scenarios"])
        arms.update(d["arms"])
        models.update(d["models"])
    order = [a for a in ALL_ARMS if a in arms]
    doc = dict(docs[-1])
    doc.update({"complete": all(d.get("complete", True) for d in docs), "runs": list(runs.values()),
                "oracle_runs": list(oracles.values()), "scenarios": scs, "arms": {a: arms[a] for a in order},
                "models": models, "seeds": sorted({r["seed"] for r in runs.values()}),
                "seconds": sum(d["seconds"] for d in docs), "criterion": criterion_text(),
                "merged_from": [os.path.basename(p) for p in paths],
                "command": "python benchmarks/rescue.py --merge " + " ".join(os.path.basename(p) for p in paths)})
    doc["summary"] = summarize(doc["runs"], scs, order)
    stem = os.path.join(out_dir, f"rescue-{time.strftime('%Y-%m-%d')}-{machine_tag()}-merged")
    write_json(stem + ".json", doc)
    with open(stem + ".md", "w", encoding="utf-8") as fh:
        fh.write(markdown(doc) + "\nMerged from: " + ", ".join(f"`{m}`" for m in doc["merged_from"]) + " (a later "
                 "file's run replaces an earlier one of the same model, scenario, arm and seed).\n")
    table = readme_table(doc)
    with open(os.path.join(out_dir, "README_rescue_table.md"), "w", encoding="utf-8") as fh:
        fh.write(table)
    print(table)
    return doc


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="~3-minute smoke run: short runs, seed 0, GPT only")
    ap.add_argument("--seeds", help="comma-separated seeds (default 0,1; --quick: 0)")
    ap.add_argument("--scenarios", help="comma-separated scenarios (default all): "
                                        + ",".join(scenarios()))
    ap.add_argument("--arms", help="comma-separated arms (default: " + ",".join(ARMS) + "; also " + ",".join(EXTRA_ARMS) + ")")
    ap.add_argument("--models", help="comma-separated models (default gpt,conv; --quick: gpt)")
    ap.add_argument("--threads", type=int, default=2, help="torch CPU threads (default 2)")
    ap.add_argument("--out", default=RESULTS_DIR, help="results folder (default benchmarks/results)")
    ap.add_argument("--rescore", metavar="JSON",
                    help="recompute scores, summary, Markdown and README table of an existing results JSON with the "
                         "current criterion (no training)")
    ap.add_argument("--merge", nargs="+", metavar="JSON",
                    help="combine result files (later ones win for the same run) into one document and README table")
    ap.add_argument("--readme-table", action="store_true",
                    help="also (re)write README_rescue_table.md for a non-default selection")
    args = ap.parse_args(argv)
    if args.rescore:
        return rescore(args.rescore, readme=True)
    if args.merge:
        return merge(args.merge, args.out)
    torch.set_num_threads(args.threads)
    seeds = [int(s) for s in args.seeds.split(",")] if args.seeds else ([0] if args.quick else list(DEFAULT_SEEDS))
    names = args.scenarios.split(",") if args.scenarios else list(scenarios())
    arms = args.arms.split(",") if args.arms else list(ARMS)
    models = args.models.split(",") if args.models else (["gpt"] if args.quick else list(MODELS))
    command = " ".join(["python benchmarks/rescue.py", *(sys.argv[1:] if argv is None else argv)])
    stem = f"rescue-{time.strftime('%Y-%m-%d')}-{machine_tag()}" + ("-quick" if args.quick else "")
    default_suite = (not args.quick and not args.scenarios and not args.arms and not args.models
                     and len(seeds) >= 2)
    if not default_suite and not args.quick:
        stem += "-custom"

    def save(doc: dict[str, Any]) -> None:
        doc["command"] = command
        write_json(os.path.join(args.out, stem + ".json"), doc)
        with open(os.path.join(args.out, stem + ".md"), "w", encoding="utf-8") as fh:
            fh.write(markdown(doc))

    doc = run_suite(models=models, scenario_names=names, arms=arms, seeds=seeds, quick=args.quick, checkpoint=save)
    save(doc)
    print(readme_table(doc))
    print(f"results: {os.path.join(args.out, stem)}.{{md,json}}")
    if default_suite or args.readme_table:
        path = os.path.join(args.out, "README_rescue_table.md")
        with open(path, "w", encoding="utf-8") as fh:
            fh.write(readme_table(doc))
        print(f"README table: {path}")
    return doc


if __name__ == "__main__":
    main()
