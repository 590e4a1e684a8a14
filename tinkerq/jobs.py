"""The job contract, written once: the function name a request of each kind is enqueued under.

Producers enqueue by these names and the worker runs only jobs that carry one of them. A name is a label, not
an import path: the worker never imports it, it hands every admitted job to its dispatcher
(`worker.rq_worker.AllowlistJob`). The names are the dotted paths the job functions once had, kept as they are
so jobs already queued in Redis under them still run after an upgrade.
"""

SAMPLE = "worker.jobs.sample"
WEIGHT_SYNC = "worker.jobs.weight_sync"
TRAINING_OP = "worker.jobs.training_op"

JOB_OF_KIND: dict[str, str] = {
    "sample": SAMPLE,
    "weight_sync": WEIGHT_SYNC,
    "create_model": TRAINING_OP,
    "forward": TRAINING_OP,
    "forward_backward": TRAINING_OP,
    "optim_step": TRAINING_OP,
    "save_state": TRAINING_OP,
    "load_state": TRAINING_OP,
    "create_custom_loss": TRAINING_OP,
    "delete_checkpoint": TRAINING_OP,
}

# The only function names a worker runs.
JOB_NAMES: frozenset[str] = frozenset(JOB_OF_KIND.values())
