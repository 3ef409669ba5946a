"""Engine plumbing of the Hugging Face ``Trainer`` adapter (``gradguard.hf``, which only translates
the Trainer's events):

* ``steps``: ``trainer.training_step`` is wrapped for the run (the Trainer is found on the call
  stack): an out-of-memory error retries the same samples in smaller chunks (and later micro-batches
  stay split); a data window skipped after a rollback is not computed; ``shrink_mode="micro"``
  splits. The forward hook that reads every micro-batch's loss.
* ``norm``: the step's decision, in the Trainer's norm pass (``_clip_grad_norm``, taken over) or in
  ``on_pre_optimizer_step``; a skipped step holds the LR scheduler for one ``step()``.
* ``loader``: the train dataloader is the core's batch controller: ``shrink_batch`` / grow-back
  change its batch size live (LR scaled linearly while it is small).
* ``checkpoints``: rollback reads the run's own ``checkpoint-*`` folders after the in-memory snapshot
  ring (a checkpoint is trusted once the step after it was healthy).
* ``state``: the guard's state is an ``ExportableState`` entry of ``trainer_state.json`` and a
  ``gradguard_state.json`` file in the checkpoint folder; ``train(resume_from_checkpoint=...)``
  restores it.
* ``setup``: what a Trainer setup gradguard cannot guard, the clip rule, the event log's folder,
  building the run; ``live``: the ``report_to`` integrations as live sinks, the Trainer's logs.
"""
