"""One admitted job becomes exactly one stored result: dispatch (`dispatcher`); a sample served with the samples
gathered into its engine run (`sampling`, `batching`); training ops in seq_id order (`sequencing`, with the ops
held for their turn: `held`), each run in its turn (`training_ops`); each result stored fenced, first writer wins
(`results`); and what a sampler records for stable_reinforce (`stability`)."""
