"""GradGuardCallback recovery paths inside a real transformers.Trainer: out-of-memory retries,
batch shrink/grow, micro-batch splitting, checkpoint-* as the rollback disk tier, fp16 scale freeze."""

from __future__ import annotations

import json

import pytest
import torch

pytest.importorskip("transformers")
from transformers import TrainerCallback  # noqa: E402

from gradguard.hf import GradGuardCallback  # noqa: E402
from tests.test_hf import Probe, cfg, inject, make_trainer, tiny_gpt2, train_logs  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")


def no_dropout():
    model = tiny_gpt2()
    for m in model.modules():
        if isinstance(m, torch.nn.Dropout):
            m.p = 0.0  # chunks draw other dropout masks: compare runs without dropout
    return model


def events(tmp_path) -> list[dict]:
    path = tmp_path / "logs" / "gradguard" / "events.jsonl"
    return [json.loads(x) for x in path.read_text().splitlines()]


def oom_above(model, limit: int, when=lambda: True):
    """A forward pre-hook that raises torch.OutOfMemoryError for micro-batches larger than ``limit``."""
    calls = {"n": 0}

    def hook(module, args, kwargs):
        if module.training and kwargs["input_ids"].shape[0] > limit and when():
            calls["n"] += 1
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (injected)")

    model.register_forward_pre_hook(hook, with_kwargs=True)
    return calls


@pytest.mark.parametrize("loss_kwargs", [True, False])
def test_oom_in_forward_retries_the_same_samples_in_chunks(tmp_path, loss_kwargs):
    plain = make_trainer(tmp_path / "a", steps=4, gradient_accumulation_steps=2, model=no_dropout())
    plain.model_accepts_loss_kwargs = loss_kwargs
    plain.train()

    probe = Probe()
    cb = GradGuardCallback(config=cfg(tmp_path))  # (monitor mode acts on nothing, OOM errors included)
    tr = make_trainer(tmp_path / "b", [cb, probe], steps=4, gradient_accumulation_steps=2, model=no_dropout())
    tr.model_accepts_loss_kwargs = loss_kwargs  # sum (num_items_in_batch) vs mean-per-micro-batch losses
    calls = oom_above(tr.model, 2)
    tr.train()  # no restart: the Trainer's loop never sees the error
    assert calls["n"] == 1 and cb.run.runner.splits == 2
    assert set(probe.batch_sizes) == {2} and len(probe.batch_sizes) == 4 * 2 * 2
    # the same samples, equally weighted: the run matches the one that never ran out of memory
    for a, b in zip(train_logs(plain), train_logs(tr)):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-4)
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-3)
        assert b["gradguard/loss"] == pytest.approx(a["loss"], rel=1e-4)
    for p, q in zip(plain.model.parameters(), tr.model.parameters()):
        assert torch.allclose(p, q, atol=1e-4)
    acts = [e for e in events(tmp_path) if e["type"] == "action"]
    assert [a["name"] for a in acts] == ["oom_shrink_micro"]
    assert acts[0]["params"]["micro_batch"] == [4, 2] and acts[0]["params"]["pieces"] == 2
    assert "training_step" not in vars(tr)  # the wrapper is gone after train()


def test_oom_during_backward_mid_accumulation_skips_that_step(tmp_path):
    probe = Probe()
    cb = GradGuardCallback(config=cfg(tmp_path))
    tr = make_trainer(tmp_path, [cb, probe], steps=5, gradient_accumulation_steps=2)
    state = {"micro": 0, "fired": False}

    class Count(TrainerCallback):
        def on_step_begin(self, args, s, control, **kw):
            state["micro"] = 0

    def fwd(module, args, kwargs):
        if module.training:
            state["micro"] += 1

    def bwd(module, grad_output):
        if tr.state.global_step + 1 == 3 and state["micro"] == 2 and not state["fired"]:
            state["fired"] = True
            raise torch.OutOfMemoryError("CUDA out of memory (injected in backward)")

    tr.add_callback(Count())
    tr.model.register_forward_pre_hook(fwd, with_kwargs=True)
    tr.model.transformer.h[0].register_full_backward_pre_hook(bwd)
    tr.train()
    assert state["fired"] and cb.run.runner.splits == 2
    assert torch.equal(probe.wte[3], probe.wte[2])  # the half-accumulated step 3 never applied
    assert probe.adam_step[:4] == [1.0, 2.0, 2.0, 3.0]
    assert probe.sched[:4] == [1, 2, 2, 3]
    assert tr.state.global_step == 5 and cb.core.skipped_steps == 1
    assert all(torch.isfinite(p).all() for p in tr.model.parameters())
    act = next(e for e in events(tmp_path) if e["type"] == "action")
    assert act["name"] == "oom_skip_step" and act["params"]["step_skipped"] and act["params"]["micro_batch"] == [4, 2]


def test_batch_shrinks_with_linear_lr_scaling_and_grows_back_under_a_tight_clip(tmp_path):
    probe = Probe()
    conf = cfg(tmp_path, policy={"ladder": [["shrink_batch"]]},
               recovery={"snapshot_interval": 0, "grow_after": 3, "grow_clip": 0.1, "grow_clip_steps": 2})
    cb = GradGuardCallback(config=conf)
    tr = make_trainer(tmp_path, [cb, probe], steps=12)
    inject(tr, {4: 4.0, 5: 4.0})
    tr.train()
    acts = {a.name: (r.step, a) for r in cb.reports for a in r.actions}
    shrink_at, shrink = acts["shrink_batch"]
    grow_at, grow = acts["grow_batch"]
    assert shrink_at == 5 and shrink.params["batch"] == [4, 2] and shrink.params["lr_scale"] == 0.5
    assert grow.params["batch"] == [2, 4] and grow_at == 5 + 3  # after three healthy steps (6, 7, 8)
    for s in range(6, grow_at + 1):  # linear scaling: half the batch, half the LR, inside the step only
        assert probe.eff_lr[s] / probe.sched_lr[s] == pytest.approx(0.5)
    assert probe.eff_lr[grow_at + 1] / probe.sched_lr[grow_at + 1] == pytest.approx(1.0)
    for s in (grow_at + 1, grow_at + 2):  # max_grad_norm held at 0.1 after growing back
        assert probe.grad_norm_at_step[s] <= 0.1 + 1e-5
    sizes = probe.batch_sizes
    assert sizes[0] == 4 and 2 in sizes and sizes[-1] == 4  # the loader really changed, both ways
    assert tr.state.global_step == 12


def test_micro_mode_splits_micro_batches_and_keeps_the_global_batch(tmp_path):
    probe = Probe()
    conf = cfg(tmp_path, policy={"ladder": [["shrink_batch"]]},
               recovery={"snapshot_interval": 0, "shrink_mode": "micro"})
    cb = GradGuardCallback(config=conf)
    tr = make_trainer(tmp_path, [cb, probe], steps=8)
    inject(tr, {4: 4.0, 5: 4.0})
    tr.train()
    act = next(a for r in cb.reports for a in r.actions if a.name == "shrink_batch")
    assert act.params["micro_batch"] == [4, 2] and act.params["accumulation"] == 2
    assert probe.batch_sizes[:5] == [4] * 5 and probe.batch_sizes[-6:] == [2] * 6  # 2 chunks per step
    assert tr.callback_handler.train_dataloader.batch_sampler.batch_size == 4  # global batch kept
    assert probe.eff_lr[7] == pytest.approx(probe.sched_lr[7])  # no LR scaling in micro mode


def test_rollback_from_the_trainers_checkpoint_when_no_snapshot_is_kept(tmp_path):
    from safetensors.torch import load_file

    probe = Probe()
    # no host-memory copies; one trust rule in every engine: trusted after confirm_steps healthy steps
    conf = cfg(tmp_path, recovery={"snapshot_interval": 0, "skip_batches": 1, "confirm_steps": 2})
    cb = GradGuardCallback(config=conf)
    tr = make_trainer(tmp_path, [cb, probe], steps=10, save_strategy="steps", save_steps=3)
    inject(tr, {7: 4.0, 8: 4.0})
    tr.train()
    rep = {r.step: r for r in cb.reports}
    rb = next(a for a in rep[8].actions if a.name == "rollback")
    # checkpoint-6 was followed by the spike at step 7, so it is not trusted: checkpoint-3 is
    to = rb.params["to_step"]
    assert to == 3
    assert rb.params["source"] == "checkpoint" and rb.params["path"].endswith(f"checkpoint-{to}")
    saved = load_file(str(tmp_path / "out" / f"checkpoint-{to}" / "model.safetensors"))
    assert torch.equal(probe.wte[8], saved["transformer.wte.weight"])  # restored bitwise
    assert probe.adam_step[7] == float(to)  # optimizer state of the checkpoint
    assert [a.name for a in rep[8].actions][:2] == ["rollback", "skip_data"]
    assert torch.equal(probe.wte[9], probe.wte[8])  # step 9: the skipped data window
    assert tr.state.global_step == 10 and all(torch.isfinite(p).all() for p in tr.model.parameters())


def test_fp16_overflow_streak_freezes_the_loss_scale(tmp_path):
    cb = GradGuardCallback(config=cfg(tmp_path))
    tr = make_trainer(tmp_path, [cb], steps=10)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10)
    acc = tr.accelerator
    acc.scaler = scaler
    acc.unscale_gradients = lambda optimizer=None: scaler.unscale_(tr.optimizer.optimizer)
    p = tr.model.transformer.h[1].mlp.c_fc.weight

    def poison(g):  # an overflow the scale cannot cure (it comes from the forward/backward, not the scale)
        return g * float("inf") if 3 <= tr.state.global_step + 1 <= 9 else g

    p.register_hook(poison)
    scales = []

    class Watch(TrainerCallback):
        def on_step_end(self, args, state, control, **kw):
            scales.append(scaler.get_scale())

    tr.add_callback(Watch())
    tr.train()
    rep = {r.step: r for r in cb.reports}
    assert all(rep[s].overflow and rep[s].skipped for s in range(3, 10))
    assert "overflow_streak" in [f.kind for f in rep[7].findings]
    assert scales[2:6] == [512.0, 256.0, 128.0, 64.0]  # the scaler halves while the cause may be the scale
    assert scales[6:9] == [64.0, 64.0, 64.0]  # from the streak on, gradguard keeps it
    assert rep[10].applied and not rep[10].overflow


def run_ddp(tmp_path, *modes: str) -> tuple[tuple[dict, dict], ...]:
    """Two processes (gloo, CPU) under torchrun; the loss fault exists on rank 1 only. Several modes
    run one after the other in one launch (one process start-up), each into ``tmp_path/<mode>``."""
    import os
    import socket
    import subprocess
    import sys

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": root}
    args = []
    for mode in modes:
        (tmp_path / mode).mkdir()
        args += [str(tmp_path / mode), mode]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(port),
           os.path.join(root, "tests", "hf_ddp_worker.py"), *args]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300 * len(modes))
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = []
    for mode in modes:
        r0, r1 = (json.loads((tmp_path / mode / f"rank{r}.json").read_text()) for r in (0, 1))
        assert r0["world"] == 2 and r0["sampler"] == "BatchSamplerShard"
        out.append((r0, r1))
    return tuple(out)


@pytest.mark.slow
def test_ddp_fault_on_one_rank_gives_identical_actions_weights_and_batch_sizes(tmp_path):
    ((r0, r1),) = run_ddp(tmp_path, "memory")
    assert r0["actions"] == r1["actions"] == [[5, "rollback"], [5, "skip_data"], [5, "shrink_batch"]]
    assert r0["skipped"] == r1["skipped"] == [4, 5]
    assert r0["weights"] == r1["weights"]  # parameters identical on both ranks
    assert r0["sizes"] == r1["sizes"]  # skipped window (step 6) not computed; halved batch afterwards
    assert r0["sizes"][:5] == [4] * 5 and r0["sizes"][-1] == 2 and len(r0["sizes"]) == 8 - 1
    # the guard's loss is the Trainer's (num_items_in_batch counted over both ranks)
    for step, loss, guard_loss in r0["logs"]:
        assert (guard_loss is None) if step == 6 else guard_loss == pytest.approx(loss, rel=1e-5)


@pytest.mark.slow
def test_ddp_rollback_to_a_checkpoint_folder_on_every_rank(tmp_path):
    """Only rank 0 writes checkpoints; every rank tracks them and restores the same one."""
    ((r0, r1),) = run_ddp(tmp_path, "checkpoint")
    assert r0["actions"] == r1["actions"] and [5, "rollback"] in r0["actions"]
    assert r0["rollback_to"] == r1["rollback_to"] == [2]  # checkpoint-4 (saved at the spike) is not trusted
    assert r0["weights"] == r1["weights"]


def test_unreadable_checkpoint_falls_back_to_the_next_older_one(tmp_path):
    probe = Probe()
    # one trust rule in every engine: trusted after recovery.confirm_steps healthy steps (1 here)
    cb = GradGuardCallback(config=cfg(tmp_path, recovery={"snapshot_interval": 0, "confirm_steps": 1}))
    tr = make_trainer(tmp_path, [cb, probe], steps=10, save_strategy="steps", save_steps=2)

    class Corrupt(TrainerCallback):  # damage checkpoint-4's weights after it was written and trusted
        def on_step_end(self, args, state, control, **kw):
            if state.global_step == 6:
                f = tmp_path / "out" / "checkpoint-4" / "model.safetensors"
                f.write_bytes(f.read_bytes()[:1000])

    tr.add_callback(Corrupt())
    inject(tr, {7: 4.0, 8: 4.0})
    tr.train()
    rb = next(a for r in cb.reports for a in r.actions if a.name == "rollback")
    assert rb.params["to_step"] == 2  # checkpoint-6: followed by the spike; checkpoint-4: unreadable
    fb = [e for e in events(tmp_path) if e["type"] == "snapshot_fallback"]
    assert len(fb) == 1 and fb[0]["wanted"] == 4 and "checkpoint-4" in fb[0]["problems"][0]
    from safetensors.torch import load_file

    saved = load_file(str(tmp_path / "out" / "checkpoint-2" / "model.safetensors"))
    assert torch.equal(probe.wte[8], saved["transformer.wte.weight"])
    assert tr.state.global_step == 10 and all(torch.isfinite(p).all() for p in tr.model.parameters())


@pytest.mark.slow
def test_ddp_out_of_memory_on_one_rank_every_rank_shrinks_the_same_way(tmp_path):
    """``recovery.oom_all_ranks``: from step 3 rank 1 alone cannot fit more than 2 of its 4 samples.
    It runs them again in 2 chunks while rank 0 waits in no collective; both ranks record the same
    action and split every later micro-batch alike, the replicas stay identical, and training
    equals the unguarded-sync run without the error (DDP's own all-reduce) up to float rounding."""
    (r0, r1), (native, _) = run_ddp(tmp_path, "oom", "oom_native")  # both runs in one launch
    assert r0["action_log"][0] == r1["action_log"][0] == [
        3, "oom_shrink_micro", {"samples": 4, "pieces": 2, "in": "forward", "step_skipped": False,
                                "micro_batch": [4, 2], "ranks": [1]}]
    assert r0["action_log"] == r1["action_log"] and r0["weights"] == r1["weights"]
    assert r0["sizes"] == [4] * 3 + [2] * 10 and r1["sizes"] == [4] * 2 + [2] * 12  # rank 1 split step 3 itself
    assert r0["skipped"] == native["skipped"] == [4, 5]  # the loss fault of the worker, handled alike
    assert [a[:2] for a in r0["action_log"][1:]] == [[s, n] for s, n, _ in native["action_log"]]
    assert max(abs(a - b) for a, b in zip(r0["params"], native["params"])) < 1e-6
