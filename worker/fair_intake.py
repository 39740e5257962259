"""How many entries each tenant's streams of a lane may give one intake read: the read's room split
between the tenants by weight, as weighted deficit round robin (Shreedhar and Varghese, 1995) does.

A tenant's share that it could not use because its streams gave less is dropped (its deficit goes
back to zero: an empty queue banks no credit); a fractional share is carried to the next read.
So while other tenants have requests, a flooding tenant takes no more of a worker's intake than
its weight's part, and it takes all of it when they have none. A tenant whose streams gave
nothing last time is asked for one entry (a probe) until they give one again: it rejoins at
once, at the cost of at most one entry per idle tenant of over-read. With equal weights (the
"fifo" fairness) every tenant gets the same share, as the reads did before weights.
"""

from __future__ import annotations

import math
from collections.abc import Container


class IntakeShares:
    def __init__(self) -> None:
        self.weights: dict[str, float] = {}  # the registry's; a tenant not named has weight 1
        self.deficits: dict[str, float] = {}  # carried between reads
        self.idle: set[str] = set()  # tenants whose streams gave nothing last time: probed

    def counts(self, tenants: list[str], room: int, waiting: Container[str] = ()) -> dict[str, int]:
        """-> how many entries to ask of each tenant (of its streams of one lane together). With no
        room, one of each tenant with nothing `waiting` in the engine: a tenant's first request
        reaches the scheduler, which orders it by service, instead of queueing behind a flood's in
        Redis (an over-read of one entry a tenant, as a probe's)."""
        if room <= 0:
            return {tenant: 1 for tenant in tenants if tenant not in waiting}
        active = [tenant for tenant in tenants if tenant not in self.idle]
        total = sum(self.weights.get(tenant, 1.0) for tenant in active)
        counts = dict.fromkeys(tenants, 1)  # the probes
        for tenant in active:
            deficit = self.deficits.get(tenant, 0.0) + room * self.weights.get(tenant, 1.0) / total
            self.deficits[tenant] = deficit
            counts[tenant] = max(1, math.floor(deficit))
        return counts

    def took(self, counts: dict[str, int], got: dict[str, int]) -> None:
        """After the read: what each tenant gave against what it was asked."""
        for tenant, asked in counts.items():
            given = got.get(tenant, 0)
            if not given:
                self.idle.add(tenant)
                self.deficits.pop(tenant, None)
                continue
            self.idle.discard(tenant)
            # what it could not use is dropped (an empty queue banks no credit); the rest carries
            self.deficits[tenant] = 0.0 if given < asked else self.deficits.get(tenant, 0.0) - given
