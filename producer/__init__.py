"""Client side of streambatch: the wire contract (and, later, the producer client)."""

from producer.protocol import SamplingParams, pick_lane

__all__ = ["SamplingParams", "pick_lane"]
