"""Which tenants a worker serves, and their lane streams.

The operators' registry (`Keys.tenants`) is read every heartbeat: a tenant added there is served
from the next beat on, every one of its lane streams (every shard it has had) read, kept and
reclaimed like the others;
the default tenant is served whether or not it is registered, so the embedded start needs no
step. A tenant removed from the registry stays served by a running worker until it restarts:
its streams may still hold entries, which must not be stranded mid-way. A request's tenant is
the tenant of the stream its entry came from, never anything the entry says (design.md, rule 2).
"""

from __future__ import annotations

from dataclasses import dataclass

import msgspec
import redis

from producer.protocol import LANES, TENANT, Keys, Lane, Tenant, decode_tenant


@dataclass(frozen=True)
class LaneStream:
    """What a lane stream carries: one tenant's requests of one lane."""

    keys: Keys  # the tenant's
    lane: Lane
    shard: int

    @property
    def tenant(self) -> str:
        return self.keys.tenant


def read_registry(client: redis.Redis, keys: Keys) -> tuple[dict[str, Tenant], list[str]]:
    """-> (the registered tenants by name, a problem with each entry that is not a tenant)."""
    tenants, problems = {}, []
    for raw_name, value in client.hgetall(keys.tenants).items():
        name = raw_name.decode(errors="replace")
        if not TENANT.fullmatch(name):
            problems.append(f"{name!r:.40}: not a tenant name")
            continue
        try:
            tenants[name] = decode_tenant(value)
        except (msgspec.DecodeError, ValueError) as error:  # ValidationError included
            problems.append(f"{name}: {error}")
    return tenants, problems


class LaneStreams:
    """The lane streams of every tenant served, fast lanes first (the order reads go in)."""

    def __init__(self, keys: Keys) -> None:
        self.keys = keys
        self.by_name: dict[str, LaneStream] = {}

    def serve(self, tenants: dict[str, int]) -> list[str]:
        """Serve these tenants too (name -> how many shards of each lane to read: the most the
        tenant has had); -> the streams that are new."""
        added = {}
        for tenant, shards in tenants.items():
            tenant_keys = self.keys.of(tenant)
            for lane in LANES:
                for shard in range(shards):
                    if (name := tenant_keys.requests(lane, shard)) not in self.by_name:
                        added[name] = LaneStream(tenant_keys, lane, shard)
        if added:
            merged = self.by_name | added
            self.by_name = {name: stream for lane in LANES for name, stream in merged.items() if stream.lane == lane}
        return list(added)

    @property
    def names(self) -> list[str]:
        return list(self.by_name)

    def of_lane(self, lane: Lane) -> dict[str, list[str]]:
        """Tenant -> its streams of the lane (its shards)."""
        streams: dict[str, list[str]] = {}
        for name, stream in self.by_name.items():
            if stream.lane == lane:
                streams.setdefault(stream.tenant, []).append(name)
        return streams

    def __getitem__(self, name: str) -> LaneStream:
        return self.by_name[name]

    @property
    def tenants(self) -> list[str]:
        return sorted({stream.tenant for stream in self.by_name.values()})
