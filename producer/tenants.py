"""The operator's tenant registry (`streambatch tenant add|remove|list|rotate-key`): for each
tenant, its entry in `Keys.tenants` (which every worker reads each heartbeat), its Redis ACL user
(producer/acl.py) and its gateway API key, kept only as a SHA-256. Redis passwords and API keys
are made here, written once to where the caller says, and never stored in the clear."""

from __future__ import annotations

import hashlib
import secrets
from dataclasses import dataclass

import msgspec
import redis

from producer.acl import role_rules, tenant_user
from producer.connect import is_cluster
from producer.protocol import Keys, Tenant, TenantSettings, check_tenant, decode_tenant

API_KEY_PREFIX = "sbk-"  # what a gateway API key starts with: easy to spot in a leak scanner


def api_key_hash(api_key: str) -> str:
    return hashlib.sha256(api_key.encode()).hexdigest()


@dataclass(frozen=True)
class Credentials:
    """What a team needs, made once: shown or saved by the caller, not kept."""

    tenant: str
    username: str
    password: str
    api_key: str
    persisted: bool  # the ACL user was saved to Redis's ACL file (False: Redis has none, it lasts until a restart)


@dataclass(frozen=True)
class Registered:
    tenant: str
    entry: Tenant
    has_user: bool  # its ACL user exists


class TenantRegistry:
    def __init__(self, client: redis.Redis, keys: Keys) -> None:
        self.client, self.keys = client, keys

    def add(self, tenant: str, weight: float = 1.0, max_backlog: int = 10_000, shards: int = 1,
            max_running: int | None = None) -> Credentials:
        """Register a new tenant with its ACL user and API key. Raises ValueError for a bad name or
        one registered already, redis.ResponseError (NOPERM) for a user who is not the operator."""
        check_tenant(tenant)
        if self.client.hexists(self.keys.tenants, tenant):
            raise ValueError(f"tenant {tenant!r} is registered already (rotate-key makes it new credentials)")
        return self._issue(tenant, Tenant(weight=weight, max_backlog=max_backlog, shards=shards, max_shards=shards,
                                          max_running=max_running))

    def update(self, tenant: str, **changes) -> Tenant:
        """Change a registered tenant's weight, max_backlog or max_running (workers apply them at
        their next heartbeat, producers within SETTINGS_REFRESH_S). Raises ValueError for a bad value."""
        unknown = set(changes) - {"weight", "max_backlog", "max_running"}
        if unknown:
            raise ValueError(f"cannot change {sorted(unknown)} here")
        entry = Tenant(**msgspec.structs.asdict(self._entry(tenant)) | changes)
        self._write(tenant, entry)
        return entry

    def reshard(self, tenant: str, shards: int) -> Tenant:
        """Spread the tenant's new requests over `shards` intake streams per lane, while requests are
        in flight: workers read every shard the tenant has had (max_shards) from their next
        heartbeat, so nothing enqueued before a reshard down is stranded, and producers move to the
        new count within producer.core.SETTINGS_REFRESH_S (an entry a producer still sends to a
        shard it no longer should is served all the same). Raises ValueError for a bad count."""
        entry = self._entry(tenant)
        entry = Tenant(**msgspec.structs.asdict(entry) | {"shards": shards,
                                                          "max_shards": max(entry.max_shards, shards)})
        self._write(tenant, entry)
        return entry

    def rotate_key(self, tenant: str) -> Credentials:
        """New Redis password and API key for a registered tenant; the old ones stop working at once."""
        return self._issue(tenant, self._entry(tenant))

    def remove(self, tenant: str) -> bool:
        """Unregister a tenant and delete its ACL user (its live connections are closed by Redis).
        Its streams stay: a worker serves them until it restarts, so nothing is stranded mid-way.
        -> whether the ACL file was saved (see Credentials.persisted)."""
        self._entry(tenant)
        self._acl("DELUSER", tenant_user(tenant))
        self.client.hdel(self.keys.tenants, tenant)
        self.client.delete(self.keys.of(tenant).settings)
        return self._save()

    def list(self) -> list[Registered]:
        users = {name.decode() for name in self.client.execute_command("ACL", "USERS")}
        entries = self.client.hgetall(self.keys.tenants)
        return [Registered(name.decode(), decode_tenant(value), tenant_user(name.decode()) in users)
                for name, value in sorted(entries.items())]

    def _entry(self, tenant: str) -> Tenant:
        value = self.client.hget(self.keys.tenants, check_tenant(tenant))
        if value is None:
            raise ValueError(f"no tenant {tenant!r} is registered")
        return decode_tenant(value)

    def _issue(self, tenant: str, entry: Tenant) -> Credentials:
        password, api_key = secrets.token_urlsafe(32), API_KEY_PREFIX + secrets.token_urlsafe(32)
        username = tenant_user(tenant)
        self._acl("SETUSER", username, "reset", "on", f">{password}", *role_rules("tenant", self.keys.of(tenant)))
        self._write(tenant, msgspec.structs.replace(entry, api_key_sha256=api_key_hash(api_key)))
        return Credentials(tenant, username, password, api_key, persisted=self._save())

    def _acl(self, *args) -> None:
        """An ACL command, on every node of a cluster (each keeps its own users; replicas too, for
        when one is promoted). A node added to the cluster later loads them from its ACL file."""
        if is_cluster(self.client):
            self.client.execute_command("ACL", *args, target_nodes=self.client.ALL_NODES)
        else:
            self.client.execute_command("ACL", *args)

    def _write(self, tenant: str, entry: Tenant) -> None:
        """The registry entry, then the settings its producers read (Keys.settings): two keys, which
        on a cluster no MULTI spans; either order loses no request (see reshard)."""
        self.client.hset(self.keys.tenants, tenant, msgspec.json.encode(entry))
        self.client.set(self.keys.of(tenant).settings,
                        msgspec.json.encode(TenantSettings(entry.shards, entry.max_backlog)))

    def _save(self) -> bool:
        """Persist the ACL users where Redis loads them from at its next start (its aclfile);
        -> False when it has none."""
        try:
            self._acl("SAVE")
        except redis.ResponseError as error:
            if "not configured to use an ACL file" not in str(error):
                raise
            return False
        return True
