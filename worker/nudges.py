"""On a cluster: the producers' enqueue nudges (Keys.enqueued, SPUBLISH in each intake stream's
slot), which an idle worker waits for, since no read blocks across nodes.

Only an idle worker follows them: it subscribes (SSUBSCRIBE, one connection per node holding its
streams' slots, each confirmed) when it turns idle and unsubscribes when it has work again, so a
busy fleet is sent no nudge at all, and a node sends each one only to the idle workers of the
stream's tenant. A nudge between the idle worker's last read and its subscription would be
missed, so `follow` says when it subscribed afresh, and the caller reads once more before waiting.
A lost connection or a moved slot drops every subscription: made anew (from a fresh slot map) at
the next wait, with the read again before it, so nothing is missed for long: at worst the wait's
timeout.
"""

from __future__ import annotations

import select
import time

import redis

from producer.connect import REDIS_FAILURES, refresh_slot_map


class Nudges:
    def __init__(self, client: redis.RedisCluster) -> None:
        self.client = client
        self.channels: list[str] = []
        self.by_node: dict[str, redis.client.PubSub] = {}  # node name -> its subscribed connection

    def set_channels(self, channels: list[str]) -> None:
        """The channels to follow from the next `follow` (any subscription now is dropped)."""
        if channels != self.channels:
            self.channels = channels
            self.stop()

    def follow(self) -> bool:
        """Subscribed to every channel, each confirmed; -> whether that took new subscriptions
        (then read again before waiting). False, and nothing followed, while a node cannot be
        reached."""
        if self.by_node or not self.channels:
            return False
        try:
            by_slot: dict[tuple[str, int], list[str]] = {}  # an SSUBSCRIBE takes one slot's channels
            for channel in self.channels:
                node = self.client.get_node_from_key(channel).name
                by_slot.setdefault((node, self.client.keyslot(channel)), []).append(channel)
            for (name, _), channels in by_slot.items():
                if name not in self.by_node:
                    self.by_node[name] = self.client.get_redis_connection(self.client.get_node(node_name=name)).pubsub()
                self.by_node[name].ssubscribe(*channels)  # sent now, confirmed below
            for pubsub in self.by_node.values():
                _confirmed(pubsub)
        except REDIS_FAILURES:
            self._lost()
        return True

    def wait(self, timeout: float) -> bool:
        """-> whether a nudge came within `timeout` s (or a subscription was lost: read again)."""
        if not self.by_node:
            time.sleep(timeout)  # nothing followed (Redis unreachable): the caller's poll is bounded
            return False
        try:
            if not self._drained():
                select.select([pubsub.connection._sock for pubsub in self.by_node.values()], [], [], timeout)
                return self._drained()
            return True
        except REDIS_FAILURES:
            self._lost()
            return True

    def stop(self) -> None:
        """Follow nothing (the worker has work): the nodes send this worker no more nudges."""
        for pubsub in self.by_node.values():
            pubsub.close()  # disconnected: the node forgets its subscriptions at once
        self.by_node = {}

    def _drained(self) -> bool:
        """Read what the connections hold; -> whether any of it was a nudge (or a moved slot's end)."""
        nudged = False
        for pubsub in self.by_node.values():
            while (message := pubsub.get_message(timeout=0)) is not None:
                if message["type"] == "sunsubscribe":  # the slot moved to another node
                    raise redis.ConnectionError(f"the server ended the subscription to {message['channel']!r}")
                nudged = nudged or message["type"] == "smessage"
        return nudged

    def _lost(self) -> None:
        self.stop()
        refresh_slot_map(self.client)


def _confirmed(pubsub: redis.client.PubSub, timeout: float = 5.0) -> None:
    """Wait for the server to confirm each channel of `pubsub` (so a nudge sent after is heard)."""
    waiting, deadline = len(pubsub.shard_channels), time.monotonic() + timeout
    while waiting:
        message = pubsub.get_message(timeout=max(0.0, deadline - time.monotonic()))
        if message is None:
            raise redis.TimeoutError("the subscription was not confirmed")
        waiting -= message["type"] == "ssubscribe"
