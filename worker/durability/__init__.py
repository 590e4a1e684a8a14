"""Whatever an acknowledged result reports survives its worker: the training journal (`journal`), periodic
checkpoints (`checkpointer`), and rebuilding a model from them on first use (`restore`)."""
