"""Cancellation as the producer sends it: the key `Keys.cancelled(id)` (with a TTL) plus the
id PUBLISHed on `Keys.cancel_channel`.

The nudge is read every turn without a round trip: the subscribed socket is only polled.
The key makes it durable: it is checked when a request is claimed (claims.py) and swept for
every running request each heartbeat, which catches a nudge lost with a pub/sub connection.
"""

from __future__ import annotations

import redis

from producer.protocol import Keys


class Cancels:
    def __init__(self, client: redis.Redis, keys: Keys) -> None:
        self.client, self.keys = client, keys
        self.subscription = client.pubsub(ignore_subscribe_messages=True)  # polled, never a blocking read
        self.subscription.subscribe(keys.cancel_channel)

    def nudged(self) -> set[str]:
        """Ids published since the last call (any request's: the caller picks its own)."""
        request_ids = set()
        while (message := self.subscription.get_message(timeout=0)) is not None:
            request_ids.add(bytes(message["data"]).decode(errors="replace"))
        return request_ids

    def swept(self, request_ids: list[str]) -> list[str]:
        """Those of `request_ids` whose cancel key is set."""
        pipe = self.client.pipeline(transaction=False)
        for request_id in request_ids:
            pipe.exists(self.keys.cancelled(request_id))
        return [request_id for request_id, cancelled in zip(request_ids, pipe.execute()) if cancelled]

    def close(self) -> None:
        self.subscription.close()
