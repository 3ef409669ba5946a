"""Worker for tests/test_hf_recovery.py::test_ddp_*: one rank of a 2-process CPU (gloo) HF Trainer
run. A loss fault on rank 1 only; writes what this rank saw to <out>/rank<R>.json."""

from __future__ import annotations

import hashlib
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from transformers import Trainer, TrainingArguments  # noqa: E402

import gradguard as gg  # noqa: E402
from gradguard.hf import GradGuardCallback  # noqa: E402
from tests._dist import shutdown  # noqa: E402
from tests.test_hf import ByteDataset, tiny_gpt2  # noqa: E402


def main(out: str, mode: str) -> None:
    """mode "memory": in-memory rollback, skipped window, batch shrink; "checkpoint": rollback to
    the run's checkpoint-* folders (no in-memory snapshots)."""
    torch.set_num_threads(1)
    rank = int(os.environ.get("RANK", "0"))
    if mode.startswith("oom"):
        # oom: from step 3 rank 1 cannot fit more than 2 of its 4 samples (recovery.oom_all_ranks);
        # oom_clean: no error, the same setting; oom_native: no error, DDP's own gradient sync
        conf = gg.GuardConfig.preset("default", output={"console": False},
                                     recovery={"snapshot_interval": 0, "oom_all_ranks": mode != "oom_native"})
        save = dict(save_strategy="no")
    elif mode == "memory":
        conf = gg.GuardConfig.preset("default", output={"console": False},
                                     policy={"ladder": [["rollback", "shrink_batch"]]},
                                     recovery={"skip_batches": 1})
        save = dict(save_strategy="no")
    else:
        conf = gg.GuardConfig.preset("default", output={"console": False}, policy={"ladder": [["rollback"]]},
                                     recovery={"snapshot_interval": 0, "confirm_steps": 1})
        save = dict(save_strategy="steps", save_steps=2)
    cb = GradGuardCallback(config=conf)
    args = TrainingArguments(output_dir=out, use_cpu=True, report_to=[], max_steps=8, per_device_train_batch_size=4,
                             learning_rate=2e-3, logging_steps=1, disable_tqdm=True, seed=0,
                             data_seed=0, dataloader_num_workers=0, ddp_backend="gloo", **save)
    model = tiny_gpt2()
    if mode.startswith("oom"):  # no dropout: a split micro-batch then gives the unsplit gradient up to rounding
        for m in model.modules():
            if isinstance(m, torch.nn.Dropout):
                m.p = 0.0
    trainer = Trainer(model=model, args=args, train_dataset=ByteDataset(), callbacks=[cb])
    sizes: list[int] = []

    def hook(module, a, kwargs, output):
        if module.training and torch.is_grad_enabled():
            sizes.append(int(kwargs["input_ids"].shape[0]))
            if rank == 1 and trainer.state.global_step + 1 in (4, 5):
                output.loss = output.loss * 4.0
        return output

    trainer.model.register_forward_hook(hook, with_kwargs=True)

    def too_big(module, a, kwargs):
        n = int(kwargs["input_ids"].shape[0])
        if mode == "oom" and rank == 1 and module.training and trainer.state.global_step + 1 >= 3 and n > 2:
            raise torch.OutOfMemoryError(f"CUDA out of memory (injected: {n} samples on rank 1)")

    trainer.model.register_forward_pre_hook(too_big, with_kwargs=True)
    trainer.train()
    digest = hashlib.sha256()
    for p in trainer.model.parameters():
        digest.update(p.detach().cpu().numpy().tobytes())
    res = {"rank": rank, "world": trainer.args.world_size,
           "actions": [[r.step, a.name] for r in cb.reports for a in r.actions],
           "rollback_to": [a.params.get("to_step") for r in cb.reports for a in r.actions if a.name == "rollback"],
           "skipped": [r.step for r in cb.reports if r.skipped], "sizes": sizes, "weights": digest.hexdigest(),
           "action_log": [[e["step"], e["name"], e["params"]] for e in cb.core.reporter.action_log],
           "params": [v for p in trainer.model.parameters() for v in p.detach().reshape(-1)[:64].tolist()],
           "sampler": type(trainer.callback_handler.train_dataloader.batch_sampler).__name__,
           "logs": [[h["step"], h["loss"], h.get("gradguard/loss")] for h in trainer.state.log_history if "loss" in h]}
    with open(os.path.join(out, f"rank{rank}.json"), "w") as fh:
        json.dump(res, fh)


if __name__ == "__main__":
    import gc

    for i in range(1, len(sys.argv), 2):  # OUT MODE [OUT MODE ...]: several runs in one launch
        main(sys.argv[i], sys.argv[i + 1])
        gc.collect()
    shutdown()  # after main returned: the trainer and its DDP wrapper are garbage now
