"""Classic pub/sub channels that the worker loop polls (the cancel nudges).

On one node redis-py reconnects a lost subscribed connection and subscribes again by itself. On a
cluster its pub/sub connection is bound to the node it first chose, which a failover may take
away for good: so after a lost connection the subscription is made anew, on a node that answers,
with every channel. Whatever was published meanwhile is lost, which the cancel keys cover:
they are swept every heartbeat.
"""

from __future__ import annotations

import redis


class Subscription:
    def __init__(self, client) -> None:
        self.client = client
        self.channels: set[str] = set()
        self.pubsub = None

    def add(self, channels: list[str]) -> None:
        new = [channel for channel in channels if channel not in self.channels]
        if new:
            self.channels.update(new)
            self._subscribed(new)

    def messages(self) -> list[dict]:
        """Every message already queued, without waiting; nothing after a lost connection (it is
        made anew at the next call)."""
        pubsub = self._subscribed()
        if pubsub is None:
            return []
        try:
            found, message = [], pubsub.get_message(timeout=0)
            while message is not None:
                found.append(message)
                message = pubsub.get_message(timeout=0)
            return found
        except (redis.ConnectionError, redis.TimeoutError):
            self.close()
            return []

    def _subscribed(self, new: list[str] = ()):
        """The subscribed connection, made (with every channel) if there is none, else with `new`
        subscribed too; None while Redis cannot be reached (or there is nothing to follow)."""
        if not self.channels:
            return None
        try:
            if self.pubsub is None:
                self.pubsub = self.client.pubsub(ignore_subscribe_messages=True)
                self.pubsub.subscribe(*self.channels)
            elif new:
                self.pubsub.subscribe(*new)
            return self.pubsub
        except (redis.ConnectionError, redis.TimeoutError):
            self.close()
            return None

    def close(self) -> None:
        if self.pubsub is not None:
            self.pubsub.close()
            self.pubsub = None
