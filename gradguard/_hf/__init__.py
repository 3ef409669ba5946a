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
* ``run``: :class:`HFRun`, one ``train()``'s state and what each event does with it (the callback in
  ``gradguard.hf`` only calls it);
* ``setup``: what a Trainer setup gradguard cannot guard, the event log's folder, building the core; ``live``: the ``report_to`` integrations as live sinks, the Trainer's logs.

How the Trainer's events map onto the core:

* ``on_train_begin``: validates the setup, builds the core on the Trainer's model, optimizer, LR
  scheduler and GradScaler, and (:class:`gradguard.clip.HFClip`) sets ``args.max_grad_norm = inf``
  so the Trainer never clips by itself. The Trainer's norm pass (``_clip_grad_norm``) is taken over for the run: it unscales
  (fp16) and runs ``core.before_step``, whose one fused pass gives the per-layer norms, the guard's
  clip, and the ``grad_norm`` value the Trainer logs (in monitor mode the Trainer's own
  ``max_grad_norm`` clip is replayed from the same norms, bit-identical to ``clip_grad_norm_``).
  ``args.max_grad_norm`` (when finite and > 0) becomes the guard's starting ``clip.max_norm``; it is
  put back at the end of training, and written with the guard's current value into checkpoints.
* a forward hook on the model reads ``outputs.loss`` of every training micro-batch; the step's loss
  is their mean, or their sum when the Trainer passed ``num_items_in_batch`` (the loss is then
  already normalised by the whole accumulated batch).
* ``on_pre_optimizer_step`` (gradients accumulated, unscaled, not clipped): ``core.before_step``.
  A skipped step sets every ``p.grad = None`` (the optimizer step is a no-op, Adam's step count
  does not move) and holds the LR scheduler for that one ``step()`` call.
* ``on_step_end``: ``core.after_step``; a halt sets ``should_training_stop`` and ``should_save``
  and writes ``diagnosis.json`` beside the event log; ``GradGuardHalt`` is raised after the save.
* ``on_log``: the run-level ``gradguard/...`` metrics are added to the Trainer's logs (the callback
  moves itself ahead of the reporting integrations so that they receive them); so are the
  per-layer ones, which every integration receives (W&B, TensorBoard, MLflow, ...) and a filter
  placed right before the progress bar removes from the printed line. ``gradguard/loss`` is the
  mean guard loss of the logging window, non-finite values included (the Trainer's
  ``logging_nan_inf_filter`` hides them from ``loss``).
* a step with a finding, skip, action or halt that is not a logging step is written into the
  ``report_to`` W&B run / TensorBoard writer at that step (``gradguard/event/<name>`` points);
  alerts go there too (``gradguard._hf.live``).
* the engine plumbing (``gradguard._hf``): the ``training_step`` runner (out-of-memory retries, data
  windows not computed), the train dataloader as the batch controller, the ``checkpoint-*`` folders
  as the rollback source, the guard's state in checkpoints.
"""
