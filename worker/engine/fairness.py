"""Fair shares between tenants inside one lane: virtual token counters (Sheng et al., "Fairness in
Serving Large Language Models", OSDI 2024).

Each tenant's counter grows with the tokens it is served (prompt and output alike, as the
scheduler computes them), divided by its weight; the waiting request to admit next is the head of
the tenant with the least counter, and a preemption's victim comes from the most-served tenant.
A tenant that becomes active again starts at the least counter among the active tenants, so idle
time banks no credit. It is work-conserving (a lone tenant gets the whole worker) and FIFO within
a tenant (TenantQueues). With "fifo" the tenant whose head arrived first goes next: one FIFO per
lane, as before tenants, the baseline ops/fairness.py compares against.

Pure Python: no torch, no redis.
"""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Iterator
from dataclasses import dataclass

from worker.engine.sequence import Sequence


@dataclass(frozen=True)
class TenantShare:
    """What the registry says of a tenant for a worker: its weight, and the most sequences of it
    that may run on one worker at once (None: no limit)."""

    weight: float = 1.0
    max_running: int | None = None


class VirtualCounters:
    def __init__(self) -> None:
        self.counters: dict[str, float] = {}
        self.shares: dict[str, TenantShare] = {}
        self.active = Counter()  # tenant -> its requests waiting or running

    def share(self, tenant: str) -> TenantShare:
        return self.shares.get(tenant) or TenantShare()

    def arrive(self, tenant: str) -> None:
        """A request of `tenant` enters the scheduler: an idle tenant's counter is lifted to the
        least of the active tenants' (not lowered: a counter never goes back)."""
        if not self.active[tenant]:
            active = [self.counters.get(other, 0.0) for other, count in self.active.items() if count]
            if active:
                self.counters[tenant] = max(self.counters.get(tenant, 0.0), min(active))
        self.active[tenant] += 1

    def leave(self, tenant: str) -> None:
        """A request of `tenant` ended."""
        self.active[tenant] -= 1
        if not self.active[tenant]:
            del self.active[tenant]

    def charge(self, tenant: str, tokens: int) -> None:
        self.counters[tenant] = self.counters.get(tenant, 0.0) + tokens / self.share(tenant).weight

    def counter(self, tenant: str, pending: int = 0) -> float:
        """The tenant's counter, with `pending` tokens of this step not charged yet."""
        return self.counters.get(tenant, 0.0) + pending / self.share(tenant).weight


class TenantQueues:
    """One lane's waiting requests: a FIFO per tenant (a preempted request back at its head). Which
    tenant goes next is the scheduler's choice (VirtualCounters)."""

    def __init__(self) -> None:
        self.by_tenant: dict[str, deque[Sequence]] = {}
        self.size = 0

    def append(self, seq: Sequence) -> None:
        self.by_tenant.setdefault(seq.tenant, deque()).append(seq)
        self.size += 1

    def appendleft(self, seq: Sequence) -> None:
        self.by_tenant.setdefault(seq.tenant, deque()).appendleft(seq)
        self.size += 1

    def remove(self, seq: Sequence) -> None:
        queue = self.by_tenant[seq.tenant]
        queue.remove(seq)
        self._drop_if_empty(seq.tenant, queue)
        self.size -= 1

    def pop(self, tenant: str) -> Sequence:
        queue = self.by_tenant[tenant]
        seq = queue.popleft()
        self._drop_if_empty(tenant, queue)
        self.size -= 1
        return seq

    def head(self, tenant: str) -> Sequence:
        return self.by_tenant[tenant][0]

    def tenants(self) -> list[str]:
        """The tenants with a request waiting."""
        return list(self.by_tenant)

    def _drop_if_empty(self, tenant: str, queue: deque) -> None:
        if not queue:
            del self.by_tenant[tenant]

    def __len__(self) -> int:
        return self.size

    def __iter__(self) -> Iterator[Sequence]:
        """Every waiting request, tenant by tenant, each tenant's in its order."""
        for queue in list(self.by_tenant.values()):
            yield from queue
