"""Redis clients for both sides, on one node or on Redis Cluster.

Cluster mode is chosen by configuration, never detected: `--redis-cluster` on every entry point,
or $STREAMBATCH_REDIS_CLUSTER=1, with the URL naming any node. Every client comes from here, with
`protocol.connection_options` (reply and connect timeouts, keepalive, health checks, no retry).
The cluster clients are redis-py's: they follow MOVED and ASK redirections and refresh their
slot map themselves, so nothing of ours remembers which node holds a slot; like the single-node
clients, they never send a command again after a lost connection (a resent XADD or fenced write
would happen twice), and each caller retries where it knows what a repeat means.

What cluster mode changes for the callers (see design.md, layout v2):
- keys of different hash tags are never in one MULTI or one script: a transaction becomes
  ordered writes, each safe to repeat or harmless when cut short (the callers say how);
- token events go out with SPUBLISH and are followed with SSUBSCRIBE (sharded pub/sub: fan-out
  stays on the request's node); the few cluster-wide nudges (cancels, enqueues) use PUBLISH;
- a read of many intake streams is one command per stream (XREADGROUP reads one slot), sent as
  one pipeline per node, and cannot block.
"""

from __future__ import annotations

import contextlib
import os

import redis
import redis.asyncio
from redis._parsers.commands import CommandsParser
from redis.backoff import NoBackoff
from redis.exceptions import AskError, ClusterDownError, RedisClusterException, SlotNotCoveredError, TryAgainError
from redis.retry import Retry

from producer.protocol import connection_options

CLUSTER_ENV = "STREAMBATCH_REDIS_CLUSTER"

# A failover or slot migration in progress: the cluster answers again within seconds.
CLUSTER_IN_TRANSITION = (ClusterDownError, TryAgainError, SlotNotCoveredError)
# A cluster node's answer to a subscription whose slot another node owns now: redis-py follows these
# for commands by itself, not for (S)SUBSCRIBE.
STALE_SLOT_MAP = (AskError,)  # MovedError is an AskError
# A reply that says nothing of the key it was for: the node could not be reached or answered that it
# cannot serve now (in a pipeline's replies, in place of a command's). Who reads one tries again.
UNREACHABLE = (redis.ConnectionError, redis.TimeoutError, *CLUSTER_IN_TRANSITION, *STALE_SLOT_MAP)
# Whatever a Redis operation can raise (the cluster client's own errors are not RedisErrors).
REDIS_FAILURES = (redis.RedisError, RedisClusterException)


# How long a write that another depends on waits for a replica (WAIT) on a cluster: a master that has
# none (its replica failed over to it, or is down) costs a write this much, and then it goes on.
REPLICATION_WAIT_MS = 100


def cluster_from_environment() -> bool:
    """$STREAMBATCH_REDIS_CLUSTER as a flag's default: 1 or true turns cluster mode on."""
    return os.environ.get(CLUSTER_ENV, "").strip().lower() in ("1", "true")


def add_cluster_flag(parser) -> None:
    """`--redis-cluster` for an entry point's argparse parser (default: the environment)."""
    parser.add_argument("--redis-cluster", action="store_true", default=cluster_from_environment(),
                        help=f"the URL names a node of a Redis Cluster (default: ${CLUSTER_ENV})")


def _cluster_options(options: dict) -> dict:
    options = {name: value for name, value in options.items() if name != "retry"}
    return options | {"retry": Retry(NoBackoff(), 0)}


class LocalKeys(CommandsParser):
    """Where the keys of EVALSHA and XREADGROUP are, worked out here. redis-py's cluster pipeline
    asks the server (COMMAND GETKEYS, a round trip) for the keys of every command whose keys can
    move, which would cost the worker one round trip per fenced write, claim and stream read."""

    def _get_moveable_keys(self, redis_conn, *args):
        words = [arg.decode(errors="replace").upper() if isinstance(arg, bytes) else str(arg).upper()
                 for arg in args]
        if words[0] in ("EVAL", "EVALSHA"):
            return list(args[3:3 + int(args[2])])
        if words[0] == "XREADGROUP" and "STREAMS" in words:
            streams = words.index("STREAMS") + 1
            return list(args[streams:streams + (len(args) - streams) // 2])
        return super()._get_moveable_keys(redis_conn, *args)


def connect(url: str, *, cluster: bool = False, password: str | None = None, blocking_ms: int = 0,
            max_connections: int | None = None, single_connection: bool = False) -> redis.Redis | redis.RedisCluster:
    """A redis-py client (sync). `blocking_ms`: the longest BLOCK its reads use; `single_connection`:
    every command on one connection, whose CLIENT ID is then the client's (both single node only)."""
    options = connection_options(blocking_ms, password)
    if max_connections is not None:
        options["max_connections"] = max_connections
    if single_connection:
        options["single_connection_client"] = True
    if cluster:
        client = redis.RedisCluster.from_url(url, **_cluster_options(options))
        client.commands_parser = LocalKeys(client)
        return client
    return redis.Redis.from_url(url, **options)


def connect_async(url: str, *, cluster: bool = False, password: str | None = None,
                  max_connections: int | None = None,
                  health_checks: bool = True) -> redis.asyncio.Redis | redis.asyncio.RedisCluster:
    """`health_checks=False`: no PING before a command on an idle connection (producer/multiplex.py
    says why its subscribed connections need none)."""
    options = connection_options(password=password)
    if not health_checks:
        options["health_check_interval"] = 0
    if max_connections is not None:
        options["max_connections"] = max_connections
    if cluster:
        return redis.asyncio.RedisCluster.from_url(url, **_cluster_options(options))
    return redis.asyncio.Redis.from_url(url, **options)


def refresh_slot_map(client) -> None:
    """Read the cluster's slot map again (a sync cluster client's), after a subscription met a node
    that no longer owns its channel or is gone; a cluster still voting is asked again later."""
    with contextlib.suppress(*REDIS_FAILURES):
        client.nodes_manager.initialize()


async def refresh_slot_map_async(client) -> None:
    with contextlib.suppress(*REDIS_FAILURES):
        await client.nodes_manager.initialize()


def is_cluster(client) -> bool:
    return isinstance(client, (redis.RedisCluster, redis.asyncio.RedisCluster))
