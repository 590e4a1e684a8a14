"""The Tinker-compatible HTTP API: the real `tinker` SDK drives the queue through it unmodified."""
