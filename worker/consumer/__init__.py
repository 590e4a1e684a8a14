"""Taking a job off a shard queue: RQ's worker adapted to a long-lived GPU process (`rq_worker`), the lease-checked
pop (`claim`), judging a popped job (`admission`), the samples taken out with it (`batched`), and putting a dead
owner's unfinished jobs back at the front of its queue (`recovery`)."""
