"""Queue and worker statistics (`Producer.stats()`), and the lenient heartbeat reader.

A worker's heartbeat is a key with a TTL holding its live stats, either as a hash of
fields or as one msgpack/JSON value. It is read leniently: a field the worker does not
write is None, a field we do not know is kept in `raw`, and a heartbeat that does not
parse at all still shows the worker by name."""

from __future__ import annotations

import json
import time
from typing import Any

import msgspec

from producer.protocol import Lane, WorkerState


class LaneStats(msgspec.Struct):
    backlog: int  # entries in the lane stream: not yet delivered + in flight
    pending: int  # delivered to a worker, not yet acknowledged


class WorkerInfo(msgspec.Struct):
    name: str
    state: WorkerState | None = None
    phase: str | None = None  # what a starting worker is doing ("building the native kernels ...")
    model: str | None = None
    running: int | None = None
    waiting: int | None = None
    kv_usage: float | None = None  # fraction of KV blocks in use, 0..1
    tokens_per_s: float | None = None
    started_at: float | None = None  # unix seconds
    raw: dict[str, Any] = msgspec.field(default_factory=dict)

    @property
    def uptime(self) -> float | None:
        return None if self.started_at is None else max(0.0, time.time() - self.started_at)


class QueueStats(msgspec.Struct):
    """The producer's tenant's lanes; the live workers and the dead letters' count are shared
    keys, None for a user that may not read them (a tenant's, under the ACL roles)."""

    lanes: dict[Lane, LaneStats]
    workers: list[WorkerInfo] | None
    dead_letters: int | None


def parse_heartbeat(key_name: str, value: bytes | dict | None) -> WorkerInfo:
    """`value` is what GET (bytes) or HGETALL (dict of bytes) returned for the key."""
    fallback_name = key_name.rsplit(":", 1)[-1]
    raw = _decode_heartbeat(value)
    raw.setdefault("name", fallback_name)
    info = WorkerInfo(name=str(raw["name"]), raw=raw)
    for field in msgspec.structs.fields(WorkerInfo):
        if field.name in raw and field.name not in ("name", "raw"):
            try:
                # strict=False: hash fields arrive as strings ("3", "0.42") and become numbers.
                setattr(info, field.name, msgspec.convert(raw[field.name], field.type, strict=False))
            except msgspec.ValidationError:
                pass  # a field we cannot read stays None; the rest still show
    return info


def _decode_heartbeat(value: bytes | dict | None) -> dict[str, Any]:
    if isinstance(value, dict):
        return {_text(k): _text(v) for k, v in value.items()}
    if not value:
        return {}
    for decode in (msgspec.msgpack.decode, json.loads):
        try:
            decoded = decode(value)
        except (msgspec.DecodeError, ValueError):
            continue
        if isinstance(decoded, dict):
            return {str(k): v for k, v in decoded.items()}
    return {}


def _text(value: bytes | str) -> str:
    return value.decode(errors="replace") if isinstance(value, bytes) else value

