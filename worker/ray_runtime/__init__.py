"""One worker across many devices on Ray: engine replicas and data-parallel trainer ranks behind the Engine and
Trainer interfaces, so the RQ consumer and the Runtime above them stay unchanged."""
