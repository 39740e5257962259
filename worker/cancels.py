"""Cancellation as the producer sends it: the key `Keys.cancelled(id)` (with a TTL) plus the
id PUBLISHed on its tenant's `Keys.cancel_channel`.

The key is the cancel; the channel only says when to look. A nudge makes the worker check the
named requests' keys before it stops any (so a bare PUBLISH, which a tenant may send on its own
channel, stops nothing that its owner did not cancel), and the keys of every running request are
swept each heartbeat, which catches a nudge lost with a pub/sub connection. The subscribed
socket is only polled, never read with a wait (worker/subscription.py).
"""

from __future__ import annotations

from producer.protocol import Keys
from worker.flight import Flight, engine_id
from worker.subscription import Subscription


class Cancels:
    def __init__(self, client) -> None:
        self.client = client
        self.subscription = Subscription(client)
        self.tenants: dict[str, str] = {}  # cancel channel -> its tenant

    def follow(self, tenants: list[Keys]) -> None:
        """Listen for these tenants' nudges too."""
        self.tenants |= {keys.cancel_channel: keys.tenant for keys in tenants}
        self.subscription.add(list(self.tenants))

    def nudged(self) -> set[str]:
        """The engine ids (`Flight.name`) of the requests named since the last call, any
        request's: the caller picks its own, and checks them (`swept`) before it stops one."""
        names = set()
        for message in self.subscription.messages():
            tenant = self.tenants.get(bytes(message["channel"]).decode(errors="replace"))
            if tenant is not None:
                names.add(engine_id(tenant, bytes(message["data"]).decode(errors="replace")))
        return names

    def swept(self, flights: list[Flight]) -> list[Flight]:
        """Those of `flights` whose cancel key is set."""
        if not flights:
            return []
        pipe = self.client.pipeline(transaction=False)
        for flight in flights:
            pipe.exists(flight.keys.cancelled(flight.request_id))
        return [flight for flight, cancelled in zip(flights, pipe.execute()) if cancelled]

    def close(self) -> None:
        self.subscription.close()
