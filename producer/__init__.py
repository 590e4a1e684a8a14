"""The library an API server uses to enqueue requests and wait for their results."""

from producer.enqueue import Producer, Ticket
from producer.errors import Rejected
from producer.result_waiter import ResultWaiter

__all__ = ["Producer", "Rejected", "ResultWaiter", "Ticket"]
