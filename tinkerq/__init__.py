"""tinkerq: ordered sample and weight-sync jobs for RL post-training, through Redis and RQ."""

__version__ = "0.1.0"
