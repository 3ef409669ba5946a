"""Scale-out in the engines: ``lightning.Trainer`` with ``GradGuardCallback`` under ``strategy="ddp"``,
``ModelParallelStrategy`` (FSDP2: ``fully_shard`` in ``configure_model``) and ``FSDPStrategy`` (FSDP1,
with and without ``use_orig_params``), two gloo processes on the CPU (tests/lightning_shard_worker.py under
torchrun). Faults exist on rank 1 only (a NaN loss at step 4, a loss spike at steps 6-7): both ranks
must take the same actions at the same steps, with the norms of one process and the weights of DDP."""

from __future__ import annotations

import pytest

from tests.test_scale import close, run, run_many

pytestmark = pytest.mark.slow

WORKER = "lightning_shard_worker.py"
# ddp_zero: DDP with a ZeroRedundancyOptimizer (ZeRO-1); fsdp: units wrapped in configure_model;
# fsdp_root: one root unit; *_flat: the same with flat
# parameters (use_orig_params=False: layers measured on slices of the flat shards); model_parallel_tp:
# ModelParallelStrategy with tensor_parallel_size=2 (a column- and a row-parallel layer, both ranks
# on the same batch)
SHARDED = ["model_parallel", "fsdp"]


FAULT = ["ddp", "ddp_zero", *SHARDED, "fsdp_root", "fsdp_flat", "fsdp_root_flat", "model_parallel_tp"]
RESUME = [*SHARDED, "fsdp_flat"]


def runs_read(item) -> list[tuple[str, str]]:
    """The worker runs (strategy, scenario) one test of this module reads."""
    strategy = getattr(item, "callspec", None) and item.callspec.params.get("strategy")
    name = getattr(item, "originalname", item.name)
    if name == "test_lightning_fault_on_one_rank_same_actions_norms_of_one_process_weights_of_ddp":
        return [(strategy, "default")] + ([("ddp", "default")] if strategy not in ("ddp", "model_parallel_tp") else [])
    if name == "test_lightning_sharded_resume_restores_the_guard_on_every_rank":
        return [(strategy, "resume")]
    if name == "test_lightning_ddp_out_of_memory_on_one_rank_every_rank_shrinks_the_same_way":
        return [("ddp", "oom"), ("ddp", "oom_native")]
    return []


@pytest.fixture(scope="module", autouse=True)
def one_launch(request, tmp_path_factory):
    """Every run the selected tests of this module read, in one launch of the worker (one process
    start-up instead of one per run); each test still asserts on its own run's results."""
    path = request.node.path
    cases = [c for item in request.session.items if item.path == path for c in runs_read(item)]
    run_many(tmp_path_factory, cases, worker=WORKER)


def lit(tmp_path_factory, strategy: str, scenario: str = "default") -> tuple[dict, dict]:
    return run(tmp_path_factory, strategy, scenario, worker=WORKER)


@pytest.mark.parametrize("strategy", FAULT)
def test_lightning_fault_on_one_rank_same_actions_norms_of_one_process_weights_of_ddp(tmp_path_factory, strategy):
    r0, r1 = lit(tmp_path_factory, strategy)
    assert r0["records"] == r1["records"]  # every step: the same findings, actions, skips, loss and norms
    assert r0["params"] == r1["params"]  # every parameter (gathered when sharded) identical on both ranks
    assert r0["sharded"] is (strategy not in ("ddp", "ddp_zero"))  # ddp_zero: DDP + ZeroRedundancyOptimizer
    assert [(r["step"], r["actions"]) for r in r0["records"] if r["actions"]] == [
        (7, [["rollback", 2], ["skip_data", None], ["lower_lr", None]])]
    assert [r["step"] for r in r0["records"] if r["skipped"]] == [4, 6, 7]
    assert r0["mult"] == r1["mult"] < 1 and r0["steps"] == r1["steps"] == 12
    # clipped (max_norm 0.3) on healthy steps: by the global norm, else the sharded weights would not be DDP's
    assert sum(r["clipped"] for r in r0["records"]) >= 5
    # the rollback's data window (1 batch) ran no forward on either rank, sharded or not
    assert r0["window"] == r1["window"] == 1 and r0["actions"]["skip_data"] == 1
    # per-layer norms of step 1 = those of the same network on both ranks' batches in one process,
    # under the unsharded names
    first = r0["records"][0]["norms"]
    assert set(first) == set(r0["ref"]) == {"net.layers.0", "net.layers.1", "net.layers.2"}
    for layer, ref in r0["ref"].items():
        assert first[layer] == pytest.approx(ref, rel=1e-6)
    if strategy not in ("ddp", "model_parallel_tp"):  # (tp: both ranks on one batch, not DDP's data)
        # each rank restored its own shards (ddp_zero: its optimizer partition): DDP's weights
        assert close(r0["params"], lit(tmp_path_factory, "ddp")[0]["params"])


@pytest.mark.parametrize("strategy", RESUME)
def test_lightning_sharded_resume_restores_the_guard_on_every_rank(tmp_path_factory, strategy):
    r0, r1 = lit(tmp_path_factory, strategy, "resume")
    for r in (r0, r1):
        # the checkpoint of step 8 (rank 0 writes the callbacks' state): a new callback on each rank
        # carries on with the same LR cut, counters and clip
        assert r["ckpt"] == "epoch=0-step=8.ckpt"
        assert r["before"]["actions"] == {"rollback": 1, "lower_lr": 1, "skip_data": 1}
        assert r["restored"] == r["before"] and r["restored"]["mult"] < 1
        assert r["steps"] == 12
    assert r0["mult"] == r1["mult"] and r0["params"] == r1["params"]


def test_lightning_ddp_out_of_memory_on_one_rank_every_rank_shrinks_the_same_way(tmp_path_factory):
    """``recovery.oom_all_ranks`` under ``strategy="ddp"``: from step 3 rank 1 alone cannot fit more than
    4 of its 8 samples. It runs them again in 2 pieces while rank 0 waits in no collective; both ranks
    record the same action and halve their micro-batch alike (accumulation 2: the global batch is
    kept), and training equals the run without the error (float rounding of the split) on both
    ranks (with DDP's own gradient sync and no error: gradguard's average of the gradients equals
    DDP's bit for bit without an error, measured once; the test allows the split's rounding)."""
    r0, r1 = lit(tmp_path_factory, "ddp", "oom")
    native = lit(tmp_path_factory, "ddp", "oom_native")[0]  # no error, DDP's own gradient sync
    want = {"samples": 8, "in": "forward", "step_skipped": False, "ranks": [1]}
    assert r0["action_log"] == r1["action_log"]
    (s1, n1, p1), (s2, n2, p2) = r0["action_log"]
    assert (s1, n1) == (3, "oom_shrink_micro") and p1 == {**want, "pieces": 2, "micro_batch": [8, 4]}
    # the batch Lightning had drawn ahead at the old size is split the same way, as in one process
    assert (s2, n2) == (4, "oom_retry") and p2 == {**want, "pieces": 2, "micro_batch": [8, 8]}
    assert r0["batch_sizes"] == r1["batch_sizes"] == [8] * 4 + [4] * 8 and r0["steps"] == 8
    assert r0["records"] == r1["records"] and r0["params"] == r1["params"] and r0["skipped"] == 0
    assert close(r0["params"], native["params"], 1e-6) and native["action_log"] == []
