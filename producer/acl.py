"""Redis ACL rules for the four roles, made from the key layout (protocol.Keys) in one place,
`role_rules`, so that renaming a key changes who may touch it with it, never silently.

- A tenant's producer (`tenant-<name>`): XADD to its own lane streams (every shard); read its
  requests' replay streams and submission keys, its streams' lengths and pending counts, and its
  settings (shards, backlog limit); SUBSCRIBE to its requests' channels; SET (and DEL) its
  submission keys, SET its cancel keys, PUBLISH on its cancel channel and, on a cluster, SPUBLISH
  on its streams' enqueue channels. Nothing else: no other tenant's key or channel, no shared key
  (registry, pins, dead letters, heartbeats), no SCAN, KEYS, EVAL, FLUSHALL, CONFIG, DEBUG, MODULE or SCRIPT, and
  no DEL or SET of a stream, nor an XADD to a replay stream (that would forge events).
- The gateway (`gateway`, producer/gateway): a producer's rights on every tenant's keys, plus
  reads of the tenant registry (API keys' hashes) and the heartbeats (the models served), and
  its Responses records. No XADD to a replay stream, no shared key written.
- The worker (`worker`): what the service does, on every tenant's keys and the shared ones, and
  no admin command.
- The operator (`operator`): stats, the tenant registry, pins, dead letters, ACL management
  (creating and removing tenant users) and cluster management, with reads of everything.
- The replicator (`replicator`): what a replica needs of its master (PSYNC, REPLCONF), no key.
No one logs in as the default user (see users_acl). `users_acl` writes the ACL file compose loads
(ops/redis/users.acl).
"""

from __future__ import annotations

import re
import secrets as randomness
from typing import Literal

from producer.protocol import ANY_NAME, LANES, Keys

Role = Literal["tenant", "gateway", "worker", "operator", "replicator"]
DEFAULT_USER, GATEWAY_USER, WORKER_USER, OPERATOR_USER = "default", "gateway", "worker", "operator"
REPLICATOR_USER = "replicator"  # what a replica logs in to its master as (masteruser)
# The users of the ACL file, besides the tenants', each with the role of its name.
SERVICE_USERS = (GATEWAY_USER, WORKER_USER, OPERATOR_USER, REPLICATOR_USER)
# In ops/redis/users.acl, where the Redis container's start puts each password's SHA-256
# (from its compose secret), so that no secret is in the file.
PASSWORD_PLACEHOLDER = "@{user}_PASSWORD_SHA256@"

# What every role's client needs; on a cluster, redis-py's client first reads the slot map and the
# command table (CLUSTER SLOTS or SHARDS, COMMAND), and writes wait for a replica (WAIT).
_BASE = ["+ping", "+multi", "+exec", "+discard", "+wait", "+cluster|slots", "+cluster|shards", "+command"]
_WORKER_COMMANDS = [
    "+xreadgroup", "+xack", "+xdel", "+xadd", "+xclaim", "+xautoclaim", "+xpending", "+xinfo|consumers",
    "+xgroup|create", "+xgroup|delconsumer", "+xtrim", "+xlen", "+xrange",
    "+evalsha", "+script|load", "+script|exists",
    "+get", "+set", "+expire", "+pexpire", "+exists", "+del", "+hgetall", "+publish", "+subscribe", "+unsubscribe",
    "+spublish", "+ssubscribe", "+sunsubscribe",  # on a cluster: the fenced write's; the enqueue nudges
    "+client|id", "+client|unblock",  # the step's end cuts the intake's blocking read short (worker/step_intake.py)
]
_OPERATOR_COMMANDS = [
    "+scan", "+type", "+get", "+exists", "+hgetall", "+hget", "+hexists", "+hset", "+hdel", "+xlen", "+xrange", "+xrevrange",
    "+set", "+del",  # the tenants' settings (Keys.settings)
    "+xpending", "+xinfo|groups", "+xinfo|consumers",
    "+acl|setuser", "+acl|deluser", "+acl|getuser", "+acl|users", "+acl|save", "+acl|whoami",
    "+cluster", "+info",  # making and resharding a Redis Cluster (redis-cli --cluster create, reshard)
]
_REPLICATOR_COMMANDS = ["+psync", "+replconf", "+ping"]


def tenant_user(tenant: str) -> str:
    return f"tenant-{tenant}"


def _pattern(name: str) -> str:
    """A key or channel name as an ACL glob: its own glob characters escaped, any id a `*`."""
    return re.sub(r"([*?\[\]\\])", r"\\\1", name).replace(ANY_NAME, "*")


def _producer_rules(keys: Keys) -> list[str]:
    """What a producer does, on `keys`' tenant's keys (every tenant's for Keys(prefix, ANY_NAME))."""
    streams = [f"~{_pattern(keys.requests(lane, ANY_NAME))}" for lane in LANES]
    return ["resetkeys", "resetchannels", "-@all", *_BASE,
            "+xlen", "+xpending", "+xrange", "+exists", "+get", "+subscribe", "+unsubscribe", "+ssubscribe",
            "+sunsubscribe",
            *(f"%R{rule}" for rule in streams), f"%R~{_pattern(keys.replay(ANY_NAME))}",
            f"%R~{_pattern(keys.submitted(ANY_NAME))}", f"%R~{_pattern(keys.settings)}",
            f"&{_pattern(keys.tokens(ANY_NAME))}",
            f"(+xadd {' '.join(streams)})",
            f"(+set +del ~{_pattern(keys.submitted(ANY_NAME))})",
            f"(+set ~{_pattern(keys.cancelled(ANY_NAME))})",
            f"(+publish &{_pattern(keys.cancel_channel)})",
            f"(+spublish {' '.join(f'&{_pattern(keys.enqueued(lane, ANY_NAME))}' for lane in LANES)})"]


def role_rules(role: Role, keys: Keys) -> list[str]:
    """The ACL rules of `role` (after `reset`), for `keys`' tenant when the role is a tenant's."""
    if role == "tenant":
        return _producer_rules(keys)
    if role == "replicator":
        return ["resetkeys", "resetchannels", "-@all", *_REPLICATOR_COMMANDS]
    if role == "gateway":  # a producer for every tenant, which also reads the registry and the heartbeats
        every = keys.of(ANY_NAME)
        records = _pattern(every.response(ANY_NAME))
        return [*_producer_rules(every), "+scan", "+type", "+hgetall", f"%R~{_pattern(keys.tenants)}",
                f"%R~{_pattern(keys.worker(ANY_NAME))}", f"%R~{records}", f"(+set ~{records})"]
    everything = [f"~{_pattern(keys.prefix)}:*", f"&{_pattern(keys.prefix)}:*"]
    commands = _WORKER_COMMANDS if role == "worker" else _OPERATOR_COMMANDS
    return ["resetkeys", "resetchannels", "-@all", *_BASE, *commands, *everything]


def users_acl(keys: Keys, secrets: dict[str, str] | None = None) -> str:
    """The ACL file: the default user and the service users (SERVICE_USERS). `secrets`: user -> the
    password rule (`#<sha256>` or `><password>`); by default the placeholders the Redis
    container's start replaces with its secrets' hashes.

    The default user cannot be off: Redis replays the append-only file's MULTI/EXEC blocks (every
    submit, and every script's writes) as the default user, checking its rights, and with it off
    drops them without a word on restart (redis/redis#14541). So it keeps every right, but its
    password is the SHA-256 of nothing anyone knows (random at each start): no client can log in
    as it, and a connection that has not logged in as another user may do nothing (NOAUTH)."""
    if secrets is None:
        secrets = {user: "#" + PASSWORD_PLACEHOLDER.format(user=user.upper())
                   for user in (DEFAULT_USER, *SERVICE_USERS)}
    else:  # a user not given one gets a password no one knows
        secrets = {user: "#" + randomness.token_hex(32) for user in (DEFAULT_USER, *SERVICE_USERS)} | secrets
    lines = [f"user {DEFAULT_USER} on {secrets[DEFAULT_USER]} resetkeys ~* resetchannels &* +@all"]
    for user in SERVICE_USERS:
        lines.append(" ".join(["user", user, "on", secrets[user], *role_rules(user, keys)]))
    return "\n".join(lines) + "\n"


if __name__ == "__main__":  # python -m producer.acl > ops/redis/users.acl
    import sys

    sys.stdout.write(users_acl(Keys()))
