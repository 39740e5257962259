"""Producer: submit requests to the lane streams, follow their events, cancel them.

The flows themselves (what is read and written, in which order, and when a stream ends)
live in producer/core.py, shared with AsyncProducer; this is their shell on redis-py.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import redis

from producer.completion import Completion
from producer.core import Call, Deliver, Flow, Operation, Pause, ProducerCore, Steps, Subscribe
from producer.errors import Disconnected
from producer.protocol import Event, Keys, Lane, Message, Request, SamplingParams, connection_options
from producer.stats import QueueStats
from producer.submission import build_request, checked_id

DEFAULT_URL = "redis://localhost:6379/0"
MAX_CONNECTIONS = 10_000  # per pool: Redis's own default maxclients (redis-py 8 would stop at 100)


class Producer:
    def __init__(self, url: str = DEFAULT_URL, *, prefix: str = "sb", max_backlog: int = 10_000,
                 claim_ttl: float = 3600, poll_interval: float = 1.0) -> None:
        """`max_backlog`: per lane, entries waiting or in flight before submit refuses.
        `claim_ttl`: seconds a submitted id stays taken while it waits for a worker (the
        longest a request may wait and still be found), and a cancel flag lives; once a worker
        finishes it, the id stays taken as long as its events stay readable (the worker's
        replay_ttl). `poll_interval`: how long the channel may stay quiet before a stream
        re-reads the replay stream."""
        self.core = ProducerCore(Keys(prefix), max_backlog, int(claim_ttl), poll_interval)
        self.keys = self.core.keys
        self.redis = redis.Redis.from_url(url, **connection_options(), max_connections=MAX_CONNECTIONS)
        # Each live stream holds a subscribed connection for as long as it lasts: in a pool of
        # their own, so that streams never take the connections commands need.
        self._listener = redis.Redis.from_url(url, **connection_options(), max_connections=MAX_CONNECTIONS)

    def close(self) -> None:
        self.redis.close()
        self._listener.close()

    def __enter__(self) -> Producer:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def submit(self, prompt: str | Request | None = None, *, messages: list[Message] | list[dict] | None = None,
               prompt_ids: list[int] | None = None, params: SamplingParams | dict | None = None,
               lane: Lane | None = None, request_id: str | None = None, deadline: float | None = None) -> Handle:
        """Validate, pick the lane, enqueue. `prompt` may also be a ready Request.
        Raises InvalidRequest (a ValueError) or QueueFull; submitting an id again
        returns a handle to the request already enqueued and enqueues nothing."""
        request = build_request(prompt, messages=messages, prompt_ids=prompt_ids, params=params,
                                lane=lane, request_id=request_id, deadline=deadline)
        lane, duplicate = self._run(self.core.submit(request))
        return Handle(self, request.id, lane, duplicate)

    def cancel(self, request_id: str) -> None:
        self._run(self.core.cancel(checked_id(request_id)))

    def stream(self, request_id: str, timeout: float | None = None) -> Iterator[Event]:
        return Handle(self, checked_id(request_id)).stream(timeout)

    def result(self, request_id: str, timeout: float | None = None) -> Completion:
        return Handle(self, checked_id(request_id)).result(timeout)

    def stats(self) -> QueueStats:
        return self._run(self.core.stats())

    def pin(self, name: str, prompt: str | None = None, *, messages: list[Message] | list[dict] | None = None,
            prompt_ids: list[int] | None = None) -> None:
        """Have every worker keep this prefix in its KV cache, never evicted, until `unpin(name)`:
        one of `prompt` (text, tokenized as a prompt is), `messages` (rendered with the chat template
        without the generation prompt: the head of every conversation that goes on from them) or
        `prompt_ids`. Only its whole KV blocks are pinned, from the next request that computes them;
        workers apply it within a heartbeat, and log a prefix that does not fit their pool. `name`
        follows the request id rule; pinning a name again replaces its prefix."""
        self._run(self.core.pin(build_request(prompt, messages=messages, prompt_ids=prompt_ids, request_id=name)))

    def unpin(self, name: str) -> bool:
        """-> False if no prefix of that name was pinned."""
        return self._run(self.core.unpin(checked_id(name)))

    def pins(self) -> dict[str, Request]:
        """The pinned prefixes, by name."""
        return self._run(self.core.pins())

    def _run(self, flow: Flow):
        """Run a flow that delivers no events; -> what it returns."""
        steps = Steps(flow)
        for _ in self._drive(steps, None):
            raise AssertionError("this flow delivers no events")
        return steps.value

    def _drive(self, steps: Steps, pubsub) -> Iterator[Event]:
        """Perform each operation, handing back its reply or its Redis error; yield what is delivered."""
        operation = steps.next()
        while operation is not None:
            if isinstance(operation, Deliver):
                yield from operation.events
                operation = steps.next()
                continue
            try:
                reply = self._perform(operation, pubsub)
            except redis.RedisError as error:
                operation = steps.next(error=flow_error(error))
            else:
                operation = steps.next(reply)

    def _perform(self, operation: Operation, pubsub):
        if isinstance(operation, Call):
            return queued(self.redis, operation).execute(raise_on_error=operation.raise_on_error)
        if isinstance(operation, Subscribe):
            return pubsub.subscribe(operation.channel)
        if isinstance(operation, Pause):
            return time.sleep(operation.seconds)
        try:
            return pubsub.get_message(ignore_subscribe_messages=not operation.subscribe_messages,
                                      timeout=operation.timeout)
        except redis.ConnectionError:
            return None  # see Listen


def queued(client, call: Call):
    """A pipeline (sync or asyncio: they queue alike) holding the call's commands, to execute."""
    pipe = client.pipeline(transaction=call.transaction)
    for command in call.commands:
        getattr(pipe, command.name)(*command.args, **command.kwargs)
    return pipe


def flow_error(error: redis.RedisError) -> Exception:
    """What a flow is told of a failed operation: a lost connection as Disconnected, the rest as is."""
    if isinstance(error, (redis.ConnectionError, redis.TimeoutError)):
        return Disconnected(f"redis: {error}")
    return error


class Handle:
    """One request: follow its events, wait for its result, cancel it."""

    def __init__(self, producer: Producer, request_id: str, lane: Lane | None = None,
                 duplicate: bool = False) -> None:
        self.producer = producer
        self.id = request_id
        self.lane = lane  # the lane stream it was enqueued on (None: not known here)
        self.duplicate = duplicate  # True: an earlier submit of this id is the request

    def __repr__(self) -> str:
        return f"Handle(id={self.id!r}, lane={self.lane!r}, duplicate={self.duplicate})"

    def cancel(self) -> None:
        self.producer.cancel(self.id)

    def result(self, timeout: float | None = None) -> Completion:
        """Wait for the end. Raises TimeoutError after `timeout` seconds."""
        return Completion.from_events(self.id, list(self.stream(timeout)))

    def stream(self, timeout: float | None = None) -> Iterator[Event]:
        """Every event of the request in seq order, each once, ending with the terminal one
        (see ProducerCore.stream for what it raises)."""
        pubsub = self.producer._listener.pubsub()
        try:
            yield from self.producer._drive(Steps(self.producer.core.stream(self.id, timeout)), pubsub)
        finally:
            pubsub.close()
