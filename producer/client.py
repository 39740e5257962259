"""Producer: submit requests to the lane streams, follow their events, cancel them, on redis-py.

The API is producer/shell.py's, the flows behind it producer/core.py's (shared with
AsyncProducer); this is their I/O on redis-py.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import Any

import redis

from producer.core import Call, Deliver, Flow, Listen, Operation, Pause, Steps, Subscribe
from producer.errors import Disconnected, NotPermitted
from producer.connect import REDIS_FAILURES, REPLICATION_WAIT_MS, UNREACHABLE, connect, is_cluster, refresh_slot_map
from producer.protocol import Event, is_tls_refusal
from producer.shell import MAX_CONNECTIONS, ProducerShell, as_is


class Producer(ProducerShell):
    """See ProducerShell for the API; every method returns its value."""

    def _connect(self, url: str, subscribing: bool = False) -> redis.Redis | redis.RedisCluster:
        return connect(url, cluster=self.cluster, password=self._password, max_connections=MAX_CONNECTIONS)

    def close(self) -> None:
        self.redis.close()
        self._listener.close()

    def __enter__(self) -> Producer:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _run(self, flow: Flow, then: Callable[[Any], Any] = as_is):
        steps = Steps(flow)
        for _ in self._drive(steps, None):
            raise AssertionError("this flow delivers no events")
        return then(steps.value)

    def _stream(self, flow: Flow) -> Iterator[Event]:
        pubsub = self._listener.pubsub()
        try:
            yield from self._drive(Steps(flow), pubsub)
        finally:
            pubsub.close()

    def _collect(self, flow: Flow, then: Callable[[list], Any]):
        return then(list(self._stream(flow)))

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
            except REDIS_FAILURES as error:
                if self.cluster and not isinstance(operation, Call):  # redis-py follows MOVED for commands only
                    refresh_slot_map(self._listener)
                operation = steps.next(error=flow_error(error))
            else:
                operation = steps.next(reply)

    def _perform(self, operation: Operation, pubsub):
        if isinstance(operation, Call):
            if len(operation.commands) == 1 and not operation.replicated:
                return direct(self.redis, operation)
            replies = queued(self.redis, operation).execute(raise_on_error=operation.raise_on_error)
            return reachable(replies[:len(operation.commands)])
        if isinstance(operation, Subscribe):
            if operation.fresh and self.cluster:  # redis-py connects again to send the SUBSCRIBE
                pubsub.disconnect()
            elif operation.fresh and pubsub.connection is not None:
                pubsub.connection.disconnect()
            return (pubsub.ssubscribe if self.cluster else pubsub.subscribe)(operation.channel)
        if isinstance(operation, Pause):
            return time.sleep(operation.seconds)
        listen = pubsub.get_sharded_message if self.cluster else pubsub.get_message
        return heard(listen(timeout=operation.timeout), operation)


def heard(message: dict | None, listen: Listen) -> dict | None:
    """A pub/sub message as a Listen hands it on: a subscription's confirmation only when waited for,
    its end (the server unsubscribed us: the channel's slot moved to another node) as Disconnected."""
    if message is None or message["type"] in ("message", "smessage"):
        return message
    if message["type"] in ("unsubscribe", "sunsubscribe"):
        raise redis.ConnectionError(f"the server ended the subscription to {message['channel']!r}")
    return message if listen.subscribe_messages else None


def reachable(replies: list) -> list:
    """A pipeline's replies, unless one of them says its node could not be reached (a cluster's
    pipeline puts that in place of the command's reply): then that error, raised."""
    for reply in replies:
        if isinstance(reply, UNREACHABLE):
            raise reply
    return replies


def queued(client, call: Call):
    """A pipeline (sync or asyncio: they queue alike) holding the call's commands, to execute; on a
    cluster a `replicated` call's WAIT follows them (its reply past the commands' own)."""
    pipe = client.pipeline(transaction=call.transaction)
    for command in call.commands:
        getattr(pipe, command.name)(*command.args, **command.kwargs)
    if call.replicated and is_cluster(client):
        pipe.execute_command("WAIT", 1, REPLICATION_WAIT_MS,
                             target_nodes=client.get_node_from_key(call.commands[0].args[0]))
    return pipe


def direct(client, call: Call) -> list:
    """A call of one command, sent as that command (sync): what a cluster client will not pipeline
    (SCAN of every node, PUBLISH) goes this way. -> its reply in a list, or its error there when
    the call does not raise."""
    [command] = call.commands
    try:
        return [getattr(client, command.name)(*command.args, **command.kwargs)]
    except redis.ResponseError as error:
        if call.raise_on_error or isinstance(error, UNREACHABLE):
            raise
        return [error]


def flow_error(error: Exception) -> Exception:
    """What a flow is told of a failed operation: a lost connection (or a cluster in the middle of a
    failover or slot migration) as Disconnected, a command the
    ACL refuses as NotPermitted, the rest as is (a refused password or TLS handshake too, which
    redis-py counts as connection errors: no retry brings them in)."""
    if isinstance(error, UNREACHABLE) and not (isinstance(error, redis.AuthenticationError) or is_tls_refusal(error)):
        return Disconnected(f"redis: {error}")
    if isinstance(error, redis.exceptions.NoPermissionError):
        return NotPermitted(f"redis: {error}")
    return error
