"""The producer's public API, written once for both clients over the flows of producer/core.py.

Producer (producer/client.py, redis-py) and AsyncProducer (producer/async_client.py,
redis.asyncio) add only the I/O: their connections, and how a flow is run (`_run`, `_stream`,
`_collect`). On Producer every method below returns its value; on AsyncProducer it returns an
awaitable of that value (`stream` an async iterator), so `await producer.submit(...)`.
"""

from __future__ import annotations

import copy
import os
from collections.abc import Callable
from typing import Any

from producer.completion import Completion
from producer.connect import cluster_from_environment
from producer.core import Flow, ProducerCore
from producer.protocol import DEFAULT_CLAIM_TTL_S, DEFAULT_TENANT, Keys, Lane, Message, Request, SamplingParams
from producer.submission import build_request, checked_id

DEFAULT_URL = "redis://localhost:6379/0"
TENANT_ENV = "STREAMBATCH_TENANT"  # the tenant a producer acts for when none is passed
MAX_CONNECTIONS = 10_000  # per pool: Redis's own default maxclients (redis-py 8 would stop at 100)


def as_is(value: Any) -> Any:
    """What `_run` hands back when told nothing else."""
    return value


class ProducerShell:
    def __init__(self, url: str = DEFAULT_URL, *, tenant: str | None = None, prefix: str = "sb",
                 max_backlog: int = 10_000, claim_ttl: float = DEFAULT_CLAIM_TTL_S, poll_interval: float = 1.0,
                 password: str | None = None, cluster: bool | None = None) -> None:
        """`tenant`: whose requests these are (default: $STREAMBATCH_TENANT, else "default"); every
        key and channel used is in that tenant's part of the layout (protocol.Keys).
        `password` takes the place of one in the URL (protocol.read_password reads one from a file).
        `max_backlog`: per lane, entries waiting or in flight before submit refuses.
        `claim_ttl`: seconds a submitted id stays taken while it waits for a worker (the
        longest a request may wait and still be found), and a cancel flag lives; once a worker
        finishes it, the id stays taken as long as its events stay readable (the worker's
        replay_ttl). `poll_interval`: how long the channel may stay quiet before a stream
        re-reads the replay stream. `cluster`: `url` names a node of a Redis Cluster (default:
        $STREAMBATCH_REDIS_CLUSTER; producer/connect.py)."""
        tenant = tenant if tenant is not None else os.environ.get(TENANT_ENV) or DEFAULT_TENANT
        self.cluster = cluster if cluster is not None else cluster_from_environment()
        self.core = ProducerCore(Keys(prefix, tenant), max_backlog, int(claim_ttl), poll_interval, self.cluster)
        self.keys = self.core.keys
        self._password = password
        self.redis = self._connect(url)
        # Each live stream holds a subscribed connection for as long as it lasts: in a pool of
        # their own, so that streams never take the connections commands need.
        self._listener = self._connect(url, subscribing=True)

    def submit(self, prompt: str | Request | None = None, *, messages: list[Message] | list[dict] | None = None,
               prompt_ids: list[int] | None = None, params: SamplingParams | dict | None = None,
               lane: Lane | None = None, request_id: str | None = None, deadline: float | None = None):
        """Validate, pick the lane, enqueue; -> a Handle. `prompt` may also be a ready Request.
        Raises InvalidRequest (a ValueError) or QueueFull; submitting an id again
        returns a handle to the request already enqueued and enqueues nothing."""
        request = build_request(prompt, messages=messages, prompt_ids=prompt_ids, params=params,
                                lane=lane, request_id=request_id, deadline=deadline)
        return self._run(self.core.submit(request), lambda submitted: Handle(self, request.id, *submitted))

    def cancel(self, request_id: str):
        return self._run(self.core.cancel(checked_id(request_id)))

    def stream(self, request_id: str, timeout: float | None = None):
        """Every event of the request in seq order, each once, ending with the terminal one
        (see ProducerCore.stream for what it raises)."""
        return self._stream(self.core.stream(checked_id(request_id), timeout))

    def result(self, request_id: str, timeout: float | None = None):
        """Wait for the end; -> a Completion. Raises TimeoutError after `timeout` seconds."""
        request_id = checked_id(request_id)
        return self._collect(self.core.stream(request_id, timeout),
                             lambda events: Completion.from_events(request_id, events))

    def events(self, request_id: str):
        """-> the request's events so far, in order, without waiting for more."""
        return self._run(self.core.events(checked_id(request_id)))

    def stats(self):
        """-> QueueStats."""
        return self._run(self.core.stats())

    def workers(self):
        """-> the live workers' heartbeats (WorkerInfo); NotPermitted for a tenant's user."""
        return self._run(self.core.workers())

    def as_tenant(self, tenant: str, max_backlog: int | None = None):
        """This producer's connections, acting for another tenant (a gateway serves every tenant
        on one pair of pools), with that tenant's backlog limit: closing either closes both."""
        other = copy.copy(self)
        other.core = ProducerCore(self.keys.of(tenant), max_backlog or self.core.max_backlog, self.core.claim_ttl,
                                  self.core.poll_interval, self.cluster)
        other.keys = other.core.keys
        return other

    def pin(self, name: str, prompt: str | None = None, *, messages: list[Message] | list[dict] | None = None,
            prompt_ids: list[int] | None = None):
        """Have every worker keep this prefix in its KV cache, never evicted, until `unpin(name)`:
        one of `prompt` (text, tokenized as a prompt is), `messages` (rendered with the chat template
        without the generation prompt: the head of every conversation that goes on from them) or
        `prompt_ids`. Only its whole KV blocks are pinned, from the next request that computes them;
        workers apply it within a heartbeat, and log a prefix that does not fit their pool. `name`
        follows the request id rule; pinning a name again replaces its prefix."""
        return self._run(self.core.pin(build_request(prompt, messages=messages, prompt_ids=prompt_ids,
                                                     request_id=name)))

    def unpin(self, name: str):
        """-> False if no prefix of that name was pinned."""
        return self._run(self.core.unpin(checked_id(name)))

    def pins(self):
        """-> the pinned prefixes (Requests), by name."""
        return self._run(self.core.pins())

    # --- the I/O, per client ------------------------------------------------------------
    def _connect(self, url: str, subscribing: bool = False):
        """A client for commands, or (`subscribing`) for the streams' subscribed connections."""
        raise NotImplementedError

    def _run(self, flow: Flow, then: Callable[[Any], Any] = as_is):
        """Run a flow that delivers no events; -> `then` of what it returns."""
        raise NotImplementedError

    def _stream(self, flow: Flow):
        """The events a flow delivers, as they come."""
        raise NotImplementedError

    def _collect(self, flow: Flow, then: Callable[[list], Any]):
        """-> `then` of the list of every event a flow delivers."""
        raise NotImplementedError


class Handle:
    """One request: follow its events, wait for its result, cancel it (through its producer, so
    on an AsyncProducer each is awaited, and `stream` is an async iterator)."""

    def __init__(self, producer: ProducerShell, request_id: str, lane: Lane | None = None,
                 duplicate: bool = False) -> None:
        self.producer = producer
        self.id = request_id
        self.lane = lane  # the lane stream it was enqueued on (None: not known here)
        self.duplicate = duplicate  # True: an earlier submit of this id is the request

    def __repr__(self) -> str:
        return f"Handle(id={self.id!r}, lane={self.lane!r}, duplicate={self.duplicate})"

    def cancel(self):
        return self.producer.cancel(self.id)

    def result(self, timeout: float | None = None):
        return self.producer.result(self.id, timeout)

    def stream(self, timeout: float | None = None):
        return self.producer.stream(self.id, timeout)
