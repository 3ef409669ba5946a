"""Engine plumbing of the Lightning adapter (``gradguard.lightning``, whose callback only maps hooks to
:class:`gradguard._lightning.run.LightningRun`): ``run`` (the per-run state: FIT_START and attach, the
optimizer-step boundary, the checkpoint entry), ``setup`` (setup checks, logger sinks), ``loader`` (the
train DataLoader as a loader handle), ``checkpoints`` (the ``ModelCheckpoint`` files as a checkpoint
source), ``steps`` (the step wrappers: out-of-memory retry, data windows not computed); Lightning's
clip: :class:`gradguard.clip.LightningClip`.

Hook -> event of the engine contract (:class:`gradguard.contract.Event`; automatic optimization,
Lightning 2.4+):

* ``on_train_start`` -> FIT_START: refusals (DeepSpeed/FSDP strategies), standing aside without an
  optimizer over the module (Lightning's mock optimizer: one warning), the clip rule
  (``gradient_clip_val`` becomes the guard's starting ``clip.max_norm``), the core on the
  LightningModule and the first optimizer, the guard state of a resumed run (RESUME); the loader
  handle, the checkpoint source and (when the policy acts) the step wrappers are attached.
* ``on_train_epoch_start`` -> EPOCH_START; ``on_train_batch_start`` -> STEP_START (a data window
  skipped after a rollback: ``training_step`` returns None, no forward/backward).
* ``on_before_backward(loss)`` -> MICRO_LOSS (Lightning's division by ``accumulate_grad_batches``
  and the loss scale are undone, without a sync).
* ``on_before_optimizer_step`` -> BEFORE_OPTIMIZER_STEP (gradients accumulated, DDP-synced,
  unscaled, not yet clipped): ``core.before_step``; a skipped step has its gradients dropped and the
  ``interval="step"`` schedulers held for that step.
* ``on_train_batch_end`` (accumulation boundary) -> AFTER_OPTIMIZER_STEP: ``core.after_step``, the
  fp16 scale the core wants kept is put back, pending micro-batch changes apply.
* ``on_save_checkpoint`` -> CHECKPOINT_SAVED (the file being written, read from ``Trainer.save_checkpoint``;
  the checkpoint's own guard state lists it); ``on_train_end`` -> FIT_END (after a halt:
  :class:`gradguard.GradGuardHalt`, unless ``output.halt_raises`` is False).
"""
