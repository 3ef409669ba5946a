"""Engine plumbing of the Hugging Face ``Trainer`` adapter (``gradguard.hf``): the train
dataloader as a loader handle, the ``checkpoint-*`` folders as a checkpoint source, and the
``training_step`` runner (out-of-memory retry in chunks, data windows not computed)."""
