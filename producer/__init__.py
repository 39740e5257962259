"""Client side of streambatch: submit requests, stream their tokens, cancel them.

Light on purpose: msgspec and redis, no torch. The wire contract is producer.protocol.
"""

import importlib

from producer.completion import Completion
from producer.errors import (Disconnected, EventsLost, InvalidRequest, NotPermitted, ProducerError, ProtocolViolation,
                             QueueFull, UnknownRequest)
from producer.protocol import DoneEvent, ErrorEvent, Event, Message, Request, SamplingParams, TokenEvent, pick_lane
from producer.stats import LaneStats, QueueStats, WorkerInfo

# The clients load on first use: the worker's engine imports producer.protocol, which runs
# this file first, and the engine must not pull in redis (tests/test_layers.py).
_CLIENTS = {"Producer": "producer.client", "Handle": "producer.shell", "AsyncProducer": "producer.async_client"}


def __getattr__(name: str):
    if name in _CLIENTS:
        return getattr(importlib.import_module(_CLIENTS[name]), name)
    raise AttributeError(f"module 'producer' has no attribute {name!r}")


__all__ = [
    "AsyncProducer", "Completion", "Disconnected", "DoneEvent", "ErrorEvent", "Event", "EventsLost", "Handle",
    "InvalidRequest", "LaneStats", "Message", "NotPermitted", "Producer", "ProducerError", "ProtocolViolation", "QueueFull",
    "QueueStats", "Request", "SamplingParams", "TokenEvent", "UnknownRequest", "WorkerInfo", "pick_lane",
]
