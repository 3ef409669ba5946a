"""Worker for tests/test_deepspeed.py: the HF Trainer with DeepSpeed ZeRO-2 (``TrainingArguments(deepspeed=...)``)
and the gradguard callback, one process under torchrun (accelerate on the CPU counts one DeepSpeed
process only). A NaN loss at step 4 (DeepSpeed's overflow check skips it), a loss spike x50 at
steps 6-7. Writes what it saw to ``<out>/rank0.json``.

usage: python -m torch.distributed.run --nproc_per_node 1 tests/hf_ds_worker.py OUT STAGE SCENARIO

SCENARIO: ``faults`` (the above; a checkpoint at step 10), ``resume`` (run after ``faults`` in the same
OUT, in a new process: resumed from its checkpoint-10 with a new callback), ``quiet`` (tests/test_quiet.py's
quiet failure).
"""

from __future__ import annotations

import json
import os
import sys

os.environ.setdefault("DS_ACCELERATOR", "cpu")
os.environ.setdefault("DS_BUILD_OPS", "0")

import torch  # noqa: E402
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import gradguard as gg  # noqa: E402
from gradguard.hf import GradGuardCallback  # noqa: E402
from tests._dist import shutdown  # noqa: E402


class Poisoned(GPT2LMHeadModel):
    poison = 1.0

    def forward(self, input_ids=None, labels=None, **kwargs):  # type: ignore[override]  # noqa: ANN001
        out = super().forward(input_ids=input_ids, labels=labels, **kwargs)
        if self.training and self.poison != 1.0:
            out.loss = out.loss * self.poison
        return out


class Faults(TrainerCallback):
    def __init__(self, model: Poisoned) -> None:
        self.model = model

    def on_step_begin(self, args, state, control, **kw):  # noqa: ANN001
        step = state.global_step + 1
        self.model.poison = {4: float("nan"), 6: 50.0, 7: 50.0}.get(step, 1.0)


def text_data(n: int) -> list[dict[str, torch.Tensor]]:
    src = open(os.__file__, "rb").read()
    rows = []
    for i in range(n):
        ids = torch.tensor(list(src[i * 64:(i * 64) + 32]), dtype=torch.long)
        rows.append({"input_ids": ids, "labels": ids})
    return rows


def main(out: str, stage_s: str, scenario: str) -> None:
    torch.manual_seed(0)
    quiet = scenario == "quiet"  # the quiet-failure setting of tests/test_quiet.py: lr 0.1, no warm-up, clip 1.0
    if quiet:
        model = Poisoned(GPT2Config(n_layer=3, n_embd=64, n_head=4, vocab_size=256, n_positions=32,
                                    bos_token_id=0, eos_token_id=0))
    else:
        model = Poisoned(GPT2Config(n_layer=2, n_head=2, n_embd=32, vocab_size=256, n_positions=32))
    ds = {"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
          "gradient_clipping": "auto", "train_batch_size": "auto", "zero_optimization": {"stage": int(stage_s)},
          "steps_per_print": 10**9}
    if quiet:
        args = TrainingArguments(output_dir=os.path.join(out, "trainer"), per_device_train_batch_size=8, max_steps=45,
                                 report_to=[], deepspeed=ds, logging_steps=5, save_strategy="no", learning_rate=0.1,
                                 lr_scheduler_type="cosine", max_grad_norm=1.0, disable_tqdm=True, seed=0)
        conf = gg.GuardConfig.preset("default", output={"console": False, "dir": out})
    else:
        args = TrainingArguments(output_dir=os.path.join(out, "trainer"), per_device_train_batch_size=4, max_steps=14,
                                 report_to=[], deepspeed=ds, logging_steps=1, save_strategy="steps", save_steps=10,
                                 learning_rate=3e-3, max_grad_norm=0.5, disable_tqdm=True)
        conf = gg.GuardConfig.preset("default", output={"console": False, "dir": out},
                                     # the 2-batch spike window escalates at its second spike, as the rollback checks want
                                 policy={"ladder": [["rollback", "lower_lr"]], "ambiguous_spikes": False},
                                     recovery={"snapshot_interval": 2, "confirm_steps": 1}, detect={"warmup_steps": 3})
    cb = GradGuardCallback(config=conf)
    logs: list[dict] = []

    class Logs(TrainerCallback):
        def on_log(self, args, state, control, logs=None, **kw):  # noqa: ANN001
            if logs:
                entry = {k: v for k, v in logs.items() if isinstance(v, (int, float))}
                entry["step"] = state.global_step
                entry["engine_clip"] = trainer.model_wrapped.optimizer.clip_grad
                out_logs.append(entry)

    out_logs = logs
    callbacks = [cb, Logs()] if quiet else [cb, Faults(model), Logs()]
    if quiet:
        from tests.test_hf import ByteDataset

        data = ByteDataset()
    else:
        data = text_data(80)
    trainer = Trainer(model=model, args=args, train_dataset=data, callbacks=callbacks)
    if scenario == "resume":  # a new process: the faults run's checkpoint-10 in the same OUT, resumed
        trainer.train(resume_from_checkpoint=os.path.join(out, "trainer", "checkpoint-10"))
    else:
        trainer.train()
    events = [json.loads(line) for line in open(cb.core.log_path)] if cb.core and cb.core.log_path else []
    state_file = os.path.join(out, "trainer", "checkpoint-10", "gradguard_state.json")
    res = {"actions": [[r.step, a.name, a.params.get("to_step"), a.params.get("replaces")] for r in cb.reports
                       for a in r.actions],
           "skipped": [r.step for r in cb.reports if r.skipped], "overflow": [r.step for r in cb.reports if r.overflow],
           "findings": [[r.step, f.kind] for r in cb.reports for f in r.findings],
           "takeover": [[r.step, f.layers, f.value, f.threshold] for r in cb.reports for f in r.findings
                        if f.kind == "norm_takeover"],
           "action_params": [[r.step, a.name, a.params] for r in cb.reports for a in r.actions],
           "mult": cb.core.lr.global_mult if cb.core else None,
           "totals": [r.total_norm for r in cb.reports], "losses": [r.loss for r in cb.reports],
           "logs": logs, "engine_events": [e for e in events if e["type"] == "engine"],
           "state_file": json.load(open(state_file)) if os.path.exists(state_file) else None,
           "engine_clip_end": trainer.model_wrapped.optimizer.clip_grad, "guard_max_norm": cb.config.clip.max_norm}
    res["resume_events"] = [e for e in events if e["type"] == "resume"]
    res["steps"] = [r.step for r in cb.reports]
    res["guard_state"] = cb.core.state_dict() if cb.core else None
    with open(os.path.join(out, f"{scenario}.json"), "w") as fh:
        json.dump(res, fh)
    with open(os.path.join(out, "rank0.json"), "w") as fh:
        json.dump(res, fh)


if __name__ == "__main__":
    main(*sys.argv[1:4])
    shutdown()
