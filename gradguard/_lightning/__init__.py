"""Engine plumbing of the Lightning adapter (``gradguard.lightning``): FIT_START and attach, the
checkpoint entry, the optimizer-step boundary, the train DataLoader as a
loader handle, the ``ModelCheckpoint`` files as a checkpoint source, the step wrappers (out-of-memory
retry, data windows not computed)."""
