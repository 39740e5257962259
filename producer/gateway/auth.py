"""Who a request is from: `Authorization: Bearer <API key>` -> its tenant, by the key's SHA-256 in
the tenant registry (`streambatch tenant add` made the key and stored only its hash). The
registry is read again at most every REFRESH_S, so a rotated or removed key stops working within
that time on every replica. A gateway with an anonymous tenant (the embedded start, the demo)
serves a request with no key, or with a key no tenant has, as that tenant."""

from __future__ import annotations

import hmac
import time

import redis.asyncio

from producer.protocol import Keys, Tenant, decode_tenant
from producer.tenants import api_key_hash

REFRESH_S = 5.0


class Unauthorized(Exception):
    """No key, or one no tenant has: a 401."""


class Tenants:
    def __init__(self, client: redis.asyncio.Redis, keys: Keys, anonymous: str | None) -> None:
        self.client, self.keys, self.anonymous = client, keys, anonymous
        self._by_hash: dict[str, str] = {}
        self.registered: dict[str, Tenant] = {}  # as of the last read
        self._read_at = float("-inf")

    async def tenant_of(self, authorization: str | None) -> str:
        """-> the tenant a request's Authorization header names; Unauthorized if none."""
        scheme, _, key = (authorization or "").partition(" ")
        if scheme.lower() != "bearer" or not key.strip():
            if self.anonymous is not None:
                return self.anonymous
            raise Unauthorized("missing API key: send `Authorization: Bearer <key>`")
        digest = api_key_hash(key.strip())
        if time.monotonic() - self._read_at > REFRESH_S:
            await self._read()
        # compare_digest: how many leading characters matched never shows in the time taken
        tenant = next((name for known, name in self._by_hash.items() if hmac.compare_digest(known, digest)), None)
        if tenant is None and self.anonymous is not None:
            return self.anonymous  # OpenAI's SDKs always send some key ("EMPTY", "none")
        if tenant is None:
            raise Unauthorized("invalid API key")
        return tenant

    async def _read(self) -> None:
        registered = {}
        for name, value in (await self.client.hgetall(self.keys.tenants)).items():
            try:
                registered[name.decode()] = decode_tenant(value)
            except ValueError:
                continue  # an entry that does not decode names no key
        self.registered, self._read_at = registered, time.monotonic()
        self._by_hash = {entry.api_key_sha256: name for name, entry in registered.items() if entry.api_key_sha256}
