"""What a master's CPU per token event owes to the round trips the events come in, and how many
events a round trip carries in a fleet far larger than this machine can run.

A worker's step sends one pipeline to each master that holds one of its running requests. With S
sequences spread over M masters by their ids' hashes, that is S / (M (1 - (1 - 1/M)^S)) events per
round trip: 64 on one master, 21 on three, about 1.3 on 120. Redis pays per round trip (a read, a
write, a turn of its event loop) besides per script, so the per-master capacity the ramp measures
on three masters holds for a fleet on many more only after that correction: each event costs
what the ramp measured plus what its write costs more in the fleet's smaller pipelines. Measured here on one
node of its own: the worker's fenced write (outbox.FENCED_WRITE, one token event of a real size
per script) in pipelines of PIPELINES scripts, Redis's own CPU per script at each size (the median of
ROUNDS), read between the sizes measured as linear in 1 / size (a fixed cost per round trip
shared by its scripts).
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass

import redis

from producer.protocol import TokenEvent, encode
from worker.outbox import FENCED_WRITE

PIPELINES = (64, 21, 8, 4, 2, 1)  # scripts per round trip
SCRIPTS_PER_SIZE = 10_000  # per round of every size
ROUNDS = 3  # interleaved, the median kept: the machine is shared
FENCE = "fence"


@dataclass(frozen=True)
class RoundTripCost:
    measured_us: dict[int, float]  # Redis's CPU per script, by pipeline size

    def per_event_us(self, events_per_round_trip: float) -> float:
        """Between the sizes measured, linear in 1 / size (a round trip's share of each script)."""
        points = sorted((1 / size, cost) for size, cost in self.measured_us.items())
        x = min(max(1 / events_per_round_trip, points[0][0]), points[-1][0])
        for (x0, y0), (x1, y1) in zip(points, points[1:]):
            if x <= x1:
                return y0 + (y1 - y0) * (x - x0) / (x1 - x0)
        return points[-1][1]


def events_per_round_trip(seqs: int, masters: int) -> float:
    """A worker's running requests over the masters holding at least one of them (ids hashed evenly)."""
    return seqs / (masters * (1 - (1 - 1 / masters) ** seqs))


def measure(url: str, scripts_per_size: int = SCRIPTS_PER_SIZE) -> RoundTripCost:
    client = redis.Redis.from_url(url)
    try:
        sha = client.script_load(FENCED_WRITE)
        event = encode(TokenEvent(seq=1, attempt=1, ids=[12_345], text=" token"))
        rounds = [{size: _cpu_per_script_us(client, sha, event, size, scripts_per_size) for size in PIPELINES}
                  for _ in range(ROUNDS)]
        measured = {size: statistics.median(found[size] for found in rounds) for size in PIPELINES}
    finally:
        client.close()
    return RoundTripCost(measured)


def masters_needed(events_per_s: float, per_core: float, measured_masters: int, seqs: int, cost: RoundTripCost,
                   utilization: float = 1.0) -> int:
    """Masters for `events_per_s`, each run at `utilization` of its core, from `per_core` events per
    master-core measured on `measured_masters`: each event costs what it cost there plus what its
    write costs more at the fleet's own events per round trip (the consumers' share as measured).
    More masters carry fewer events per round trip, so the count is found by iteration."""
    at_measured_us = cost.per_event_us(events_per_round_trip(seqs, measured_masters))
    masters = math.ceil(events_per_s / (per_core * utilization))
    for _ in range(100):  # rises to its fixed point in a few rounds
        extra_us = cost.per_event_us(events_per_round_trip(seqs, masters)) - at_measured_us
        needed = math.ceil(events_per_s * (1 / per_core + extra_us / 1e6) / utilization)
        if needed <= masters:
            return masters
        masters = needed
    return masters


def _cpu_per_script_us(client: redis.Redis, sha: str, event: bytes, size: int, scripts: int) -> float:
    client.flushall()
    keys = [(f"a:{{{k}}}", f"r:{{{k}}}", f"s:{{{k}}}") for k in range(size)]
    for attempt, _, _ in keys:
        client.set(attempt, FENCE)
    before = _cpu_s(client)
    for _ in range(scripts // size):
        pipe = client.pipeline(transaction=False)
        for attempt, replay, submitted in keys:
            pipe.evalsha(sha, 3, attempt, replay, submitted, FENCE, "channel", "e", 1000, 60, 0, "PUBLISH", event)
        pipe.execute()
    spent = _cpu_s(client) - before
    return round(1e6 * spent / (size * (scripts // size)), 2)


def _cpu_s(client: redis.Redis) -> float:
    found = client.info("cpu")
    return found["used_cpu_user"] + found["used_cpu_sys"]
