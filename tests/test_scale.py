"""Scale-out in the plain loop: ``gg.Guard`` on DDP, FSDP2 (``fully_shard``) and FSDP1 models (with and
without ``use_orig_params``), DDP with torch's ``ZeroRedundancyOptimizer`` (ZeRO-1: ``zero``) and tensor
parallelism (``tp``), two
gloo processes on the CPU (tests/plain_dist_worker.py under torchrun). Faults exist on rank 1 only
(a NaN loss at step 4, a garbage-label window with a loss spike at steps 6-7): both ranks must take
the same actions at the same steps, and the weights must match across ranks and strategies."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import warnings

import pytest

pytestmark = pytest.mark.slow

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_RUNS: dict[tuple[str, str, str, int], tuple[dict, ...]] = {}


def _launch(worker: str, nproc: int, args: list[str], timeout: float) -> subprocess.CompletedProcess:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": ROOT}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc), "--master_port", str(port),
           os.path.join(ROOT, "tests", worker), *args]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)


def run(tmp_path_factory, strategy: str, scenario: str = "default",
        worker: str = "plain_dist_worker.py", nproc: int = 2) -> tuple[dict, ...]:
    """Both ranks' results of one 2-process run of ``tests/<worker>`` (cached per session: several
    tests read one run; ``run_many`` fills the cache for several runs in one launch)."""
    key = (strategy, scenario, worker, nproc)
    if key not in _RUNS:
        out = tmp_path_factory.mktemp(f"{strategy}-{scenario}")
        proc = _launch(worker, nproc, [str(out), strategy, scenario], timeout=120)
        assert proc.returncode == 0, proc.stderr[-3000:]
        _RUNS[key] = tuple(json.loads((out / f"rank{r}.json").read_text()) for r in range(nproc))
    return _RUNS[key]


def run_many(tmp_path_factory, cases, worker: str = "plain_dist_worker.py", nproc: int = 2) -> None:
    """The runs ``cases`` (``(strategy, scenario)`` pairs) of ``tests/<worker>`` in one launch: the
    worker loops over them (``OUT STRATEGY SCENARIO`` repeated), so the process start-up, the imports
    and the process group are paid once. Each run's results are cached for ``run`` exactly as one
    launch of its own would have left them. A failed launch caches nothing: each test then launches
    its runs alone (and reports its own error)."""
    todo = [c for c in dict.fromkeys(cases) if (*c, worker, nproc) not in _RUNS]
    if len(todo) < 2:  # nothing to share: run() launches a single one
        return
    outs = [tmp_path_factory.mktemp(f"{strategy}-{scenario}") for strategy, scenario in todo]
    args = [a for out, (strategy, scenario) in zip(outs, todo) for a in (str(out), strategy, scenario)]
    try:
        proc = _launch(worker, nproc, args, timeout=60 + 60 * len(todo))
    except subprocess.TimeoutExpired:
        warnings.warn(f"one launch of {len(todo)} runs of {worker} timed out: each runs alone", stacklevel=2)
        return
    if proc.returncode != 0:
        warnings.warn(f"one launch of {len(todo)} runs of {worker} failed, each runs alone: {proc.stderr[-2000:]}",
                      stacklevel=2)
        return
    for out, (strategy, scenario) in zip(outs, todo):
        _RUNS[(strategy, scenario, worker, nproc)] = tuple(
            json.loads((out / f"rank{r}.json").read_text()) for r in range(nproc))


def runs_read(item) -> list[tuple[str, str, str, int]]:
    """The worker runs (strategy, scenario, worker, nproc) one test of this module reads."""
    s = item.callspec.params.get("strategy") if hasattr(item, "callspec") else None
    oom = "plain_oom_worker.py"
    return {
        "test_fault_on_one_rank_same_actions_on_both_and_norms_of_one_process":
            [(s, "default")] + ([("ddp", "default")] if s not in ("ddp", "tp") else []),
        "test_clip_with_the_global_norm_adam_change_and_a_layer_lr_on_every_rank":
            [(s, "clip")] + ([("ddp", "clip")] if s != "ddp" else []),
        "test_fsdp2_disk_snapshots_one_file_per_rank_and_the_same_rollback": [("fsdp2", "disk"), ("ddp", "disk")],
        "test_sharded_resume_restores_the_guard_on_every_rank": [(s, "resume"), (s, "default")],
        "test_fsdp1_monitor_applies_the_users_fixed_clip_with_the_global_norm":
            [("fsdp1_one", "monitor_clip"), ("ddp", "monitor_clip")],
        "test_a_snapshot_damaged_on_one_rank_all_ranks_roll_back_to_the_same_older_step": [(s, "disk_damaged")],
        "test_hybrid_sharding_2x2_mesh_norms_of_one_process_same_actions_on_four_ranks": [(s, "default", 4)],
        "test_fsdp2_with_tensor_parallelism_2d_mesh_norms_of_one_process_same_actions_on_four_ranks":
            [("fsdp_tp", "default", 4)],
        # (oom_single, whose error ends its run on every rank, keeps a launch of its own)
        "test_ddp_out_of_memory_on_one_rank_every_rank_shrinks_the_same_way": [("ddp", "oom", oom), ("ddp", "none", oom)],
        "test_ddp_batch_shrink_on_every_rank_after_a_spike_on_one": [("ddp", "shrink", oom)],
    }.get(getattr(item, "originalname", item.name), [])


@pytest.fixture(scope="module", autouse=True)
def one_launch(request, tmp_path_factory):
    """Every run the selected tests of this module read, one launch per worker and process count
    (one process start-up instead of one per run); each test still asserts on its own run's results."""
    groups: dict[tuple[str, int], list[tuple[str, str]]] = {}
    for item in request.session.items:
        if item.path == request.node.path:
            for case in runs_read(item):
                strategy, scenario = case[:2]
                worker = next((c for c in case[2:] if isinstance(c, str)), "plain_dist_worker.py")
                nproc = next((c for c in case[2:] if isinstance(c, int)), 2)
                groups.setdefault((worker, nproc), []).append((strategy, scenario))
    for (worker, nproc), cases in groups.items():
        run_many(tmp_path_factory, cases, worker=worker, nproc=nproc)


def same_decisions(r0: dict, r1: dict) -> None:
    for k in ("actions", "skipped", "clipped", "findings", "losses", "totals", "mult", "max_norm", "betas", "steps"):
        assert r0[k] == r1[k], k
    assert r0["weights"] == r1["weights"]  # every parameter identical on both ranks (gathered under FSDP)


def close(a: list[float], b: list[float], tol: float = 1e-5) -> bool:
    return len(a) == len(b) and all(abs(x - y) <= tol * (1 + abs(y)) for x, y in zip(a, b))


@pytest.mark.parametrize("strategy", ["ddp", "fsdp2", "fsdp1_orig", "fsdp1_one", "zero", "tp"])
def test_fault_on_one_rank_same_actions_on_both_and_norms_of_one_process(tmp_path_factory, strategy):
    """tp (tensor parallelism: two DTensor-sharded layers beside a plain one, every rank on rank 0's
    batch): the norms are one process's on that batch, and a clip and the update ratios handle
    DTensor and plain tensors together (one fused kernel refused the mix)."""
    r0, r1 = run(tmp_path_factory, strategy)
    same_decisions(r0, r1)
    assert r0["skipped"] == [4, 6, 7]  # the NaN step and the spike window, on both ranks
    assert [a[:2] for a in r0["actions"]] == [[7, "rollback"], [7, "lower_lr"]] and r0["actions"][0][2] == 2
    assert r0["mult"] < 1
    # per-layer norms = those of the same model on both ranks' batches in one process; unsharded names
    assert set(r0["norms"]) == set(r0["ref"]) == {"layers.0", "layers.1", "layers.2"}
    for layer, ref in r0["ref"].items():
        assert r0["norms"][layer] == pytest.approx(ref, rel=1e-6)
    if strategy == "tp":
        assert r0["clipped"]  # healthy steps clipped (max_norm 1.0) across the mixed gradients
        assert r0["ratio_steps"]  # update ratios of the mixed parameters (log_interval 3) written
    elif strategy != "ddp":  # the gathered sharded weights (zero: each rank restored its optimizer shard) are DDP's
        assert close(r0["params"], run(tmp_path_factory, "ddp")[0]["params"])


@pytest.mark.parametrize("strategy", ["ddp", "fsdp2"])
def test_three_bad_batches_on_one_rank_roll_back_without_a_cut_and_return_on_trial_on_every_rank(
        tmp_path_factory, strategy):
    """Three spikes on one rank's batches, at a steady LR (``policy.ambiguous_spikes``): both ranks
    skip the first two, roll back at the third without an LR cut, and at the next (clean) batch
    return to the weights they left, on trial: the same steps, the same weights on both ranks."""
    r0, r1 = run(tmp_path_factory, strategy, "ambiguous")
    same_decisions(r0, r1)
    assert r0["skipped"] == [4, 6, 7, 8, 9]
    assert [a[:2] for a in r0["actions"]] == [[8, "rollback"], [9, "undo_rollback"]]
    assert r0["mult"] == 1.0


@pytest.mark.parametrize("strategy", ["ddp", "fsdp2", "fsdp1_one", "zero"])
def test_clip_with_the_global_norm_adam_change_and_a_layer_lr_on_every_rank(tmp_path_factory, strategy):
    """Clipping on healthy steps, the adam rung, and from step 3 the middle layer's LR x0.1 (under
    fsdp1_one that layer is a slice of the one flat parameter, whose shard boundary cuts a weight)."""
    r0, r1 = run(tmp_path_factory, strategy, "clip")
    same_decisions(r0, r1)
    assert len(r0["clipped"]) >= 8 and r0["max_norm"] < 0.4  # clipped healthy steps; tightened after the spike
    assert r0["betas"][0][1] < 0.999  # the adam rung applied on both ranks
    assert r0["layer_mult"] == r1["layer_mult"] == {"layers.1": 0.1}
    if strategy != "ddp":  # clipped by the global norm, the layer's LR on its slice only: DDP's weights
        assert close(r0["params"], run(tmp_path_factory, "ddp", "clip")[0]["params"])


def test_fsdp2_disk_snapshots_one_file_per_rank_and_the_same_rollback(tmp_path_factory):
    r0, r1 = run(tmp_path_factory, "fsdp2", "disk")
    same_decisions(r0, r1)
    assert [a[:3] for a in r0["actions"]] == [[7, "rollback", 2]]
    dirs = {f.split("/")[0] for f in r0["disk_files"]}, {f.split("/")[0] for f in r1["disk_files"]}
    assert len(dirs[0]) == len(dirs[1]) == 1 and dirs[0] != dirs[1]  # each rank writes its own files
    assert any(f.endswith(".pt") for f in r0["disk_files"]) and any(f.endswith(".pt") for f in r1["disk_files"])
    ddp = run(tmp_path_factory, "ddp", "disk")[0]  # restored from each rank's own shard file
    assert ddp["actions"] == r0["actions"] and close(r0["params"], ddp["params"])


@pytest.mark.parametrize("strategy", ["fsdp2", "fsdp1_one"])
def test_sharded_resume_restores_the_guard_on_every_rank(tmp_path_factory, strategy):
    """The state saved by each rank loads on every rank (its model signature uses the unsharded
    names and shapes, also of FSDP1 flat parameters)."""
    r0, r1 = run(tmp_path_factory, strategy, "resume")
    same_decisions(r0, r1)
    plain = run(tmp_path_factory, strategy)[0]
    # a new guard loaded at step 8 carries on exactly as the original (LR multiplier, counters, clip)
    assert r0["steps"] == 12 and r0["mult"] == plain["mult"] < 1
    assert close(r0["params"], plain["params"], 1e-6)


def test_fsdp1_monitor_applies_the_users_fixed_clip_with_the_global_norm(tmp_path_factory):
    """A watching guard with ``clip={"mode": "fixed"}`` applies the user's clip. Under FSDP1 torch's
    ``clip_grad_norm_`` sees one rank's shards only (each rank its own coefficient); the guard clips
    by the global norm it measured, as FSDP1's ``model.clip_grad_norm_`` does: DDP's weights (they
    differed by 4e-3 before)."""
    r0, r1 = run(tmp_path_factory, "fsdp1_one", "monitor_clip")
    ddp = run(tmp_path_factory, "ddp", "monitor_clip")[0]
    assert r0["actions"] == ddp["actions"] == [] and r0["weights"] == r1["weights"]
    assert close(r0["params"], ddp["params"], 1e-6)
    # the user's clip acted on every step (norm over 0.2), with the norm DDP's clip_grad_norm_ returns
    assert all(n > 0.2 for n in r0["engine_norms"]) and close(r0["engine_norms"], ddp["engine_norms"], 1e-6)


def test_fsdp1_flat_parameters_a_torch_without_the_known_layout_is_refused_at_attach(monkeypatch):
    """FSDP1 flat parameters are read through the private ``FlatParameter`` layout; when a torch
    lacks it (``gradguard._compat.fsdp1_flat_pieces`` answers None) the guard refuses at attach
    with the alternatives rather than measure a flat buffer as one layer."""
    import torch
    from torch import nn

    import gradguard as gg
    import gradguard._shard as shard

    monkeypatch.setattr(shard, "fsdp1_flat_pieces", lambda model: None)
    model = nn.Linear(3, 2)
    with pytest.raises(gg.UnsupportedSetupError) as err:
        gg.Guard(model, torch.optim.SGD(model.parameters(), lr=0.1))
    text = str(err.value)
    assert "use_orig_params=False" in text and "use_orig_params=True" in text and "fully_shard" in text


@pytest.mark.parametrize("strategy", ["fsdp2", "fsdp1_one"])
def test_a_snapshot_damaged_on_one_rank_all_ranks_roll_back_to_the_same_older_step(tmp_path_factory, strategy):
    """Under FSDP1 reading the model's state is a collective: every rank makes it before reading its
    file, so the rank with the damaged file does not leave the other waiting (it hung before)."""
    r0, r1 = run(tmp_path_factory, strategy, "disk_damaged")
    same_decisions(r0, r1)  # without the vote rank 1 alone would fall back to step 0: the weights would differ
    assert [a[:3] for a in r0["actions"]] == [[7, "rollback", 0]]
    assert any("unreadable on another process" in p for e in r0["fallbacks"] for p in e["problems"])
    assert r0["log"] and r1["log"] is None  # one event log per run, written by rank 0


@pytest.mark.parametrize("strategy", ["hsdp", "fsdp1_hsdp"])
def test_hybrid_sharding_2x2_mesh_norms_of_one_process_same_actions_on_four_ranks(tmp_path_factory, strategy):
    """HSDP (2 replicas x 2 shards, 4 processes; FSDP2 on a 2-D mesh, or FSDP1 ``HYBRID_SHARD`` with
    flat parameters): a replicated shard counts once."""
    ranks = run(tmp_path_factory, strategy, nproc=4)
    for r in ranks[1:]:
        same_decisions(ranks[0], r)
    r0 = ranks[0]
    assert r0["world"] == 4 and r0["skipped"] == [4, 6, 7]
    assert set(r0["norms"]) == set(r0["ref"]) == {"layers.0", "layers.1", "layers.2"}
    for layer, ref in r0["ref"].items():
        assert r0["norms"][layer] == pytest.approx(ref, rel=1e-6)


def test_fsdp2_with_tensor_parallelism_2d_mesh_norms_of_one_process_same_actions_on_four_ranks(tmp_path_factory):
    """torchtitan's layout: tensor parallelism in pairs of ranks, FSDP2 across the pairs (4 processes).
    FSDP2 shards a column-parallel weight again along the dimension TP already splits
    (``_StridedShard``, which is not a ``Shard``): such a piece counts once, not as a replica (its
    layer's norm was 1/sqrt(2) of one process's); the update ratios of DTensor parameters are written."""
    ranks = run(tmp_path_factory, "fsdp_tp", nproc=4)
    for r in ranks[1:]:
        same_decisions(ranks[0], r)
    r0 = ranks[0]
    assert r0["world"] == 4 and r0["skipped"] == [4, 6, 7] and r0["ratio_steps"]
    assert set(r0["norms"]) == set(r0["ref"]) == {"layers.0", "layers.1", "layers.2"}
    for layer, ref in r0["ref"].items():
        assert r0["norms"][layer] == pytest.approx(ref, rel=1e-6)


def test_ddp_out_of_memory_on_one_rank_every_rank_shrinks_the_same_way(tmp_path_factory):
    """``Guard.accumulate`` on DDP: rank 1 alone cannot fit more than 3 samples from step 3 on. It runs
    its samples again in pieces while rank 0 waits in no collective; then both ranks take the same
    action, shrink their micro-batch alike, and train on the same averaged gradient as without the
    error (the split changes only float rounding)."""
    r0, r1 = run(tmp_path_factory, "ddp", "oom", worker="plain_oom_worker.py")
    clean = run(tmp_path_factory, "ddp", "none", worker="plain_oom_worker.py")[0]
    assert r0["error"] is None and r1["error"] is None
    want = [[3, "oom_shrink_micro", {"samples": 8, "pieces": 4, "in": "forward", "step_skipped": False,
                                     "micro_batch": [8, 2], "ranks": [1]}]]
    assert r0["actions"] == r1["actions"] == want
    assert r0["micro"] == r1["micro"] == [8, 8] + [2] * 6 and clean["micro"] == [8] * 8
    assert r0["skipped"] == [] and r0["losses"] == r1["losses"]
    assert r0["weights"] == r1["weights"]  # the replicas stay identical
    assert clean["actions"] == [] and close(r0["params"], clean["params"], 1e-6)
    assert r0["gain"] == r1["gain"] == 1.0  # rank 0's buffer broadcast, as DDP does
    for layer, ref in r0["ref"].items():  # the gradient averaged over ranks = one process on both batches
        assert r0["norms"][layer] == pytest.approx(ref, rel=1e-6)


def test_ddp_a_sample_that_fits_on_no_rank_raises_on_every_rank_without_a_hang(tmp_path_factory):
    r0, r1 = run(tmp_path_factory, "ddp", "oom_single", worker="plain_oom_worker.py")
    for r in (r0, r1):
        assert r["error"][0] == 3 and "rank(s) [1] of 2" in r["error"][1] and "single sample" in r["error"][1]
        assert r["micro"] == [8, 8] and r["actions"] == []


def test_ddp_batch_shrink_on_every_rank_after_a_spike_on_one(tmp_path_factory):
    """The ``shrink_batch`` rung under DDP (a ``BatchController`` per rank): a loss spike in rank 1's
    batches only halves every rank's global batch at the same step, with the LR scaled alike."""
    r0, r1 = run(tmp_path_factory, "ddp", "shrink", worker="plain_oom_worker.py")
    assert r0["actions"] == r1["actions"] == [[6, "shrink_batch", {"rung": 1, "batch": [8, 4], "lr_scale": 0.5}]]
    assert r0["sizes"] == r1["sizes"] == [8] * 6 + [4] * 4  # the same samples per step on both ranks
    assert r0["skipped"] == r1["skipped"] == [5] and r0["weights"] == r1["weights"]
