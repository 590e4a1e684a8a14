"""One admitted job becomes exactly one stored result: dispatch (`dispatcher`), samples gathered into one engine
run (`batching`), training ops in seq_id order (`sequencing`, with the ops held for their turn: `held`), and what a
sampler records for stable_reinforce (`stability`)."""
