"""Many streams of one AsyncProducer on a few connections (a gateway follows a thousand at once).

- SharedSubscription: one subscribed connection carries every stream's channel. A reader task
  reads it and hands each message to the listeners of its channel; a lost connection is handed
  to every listener (each stream then re-reads its replay stream, as with a connection of its
  own), and the reader tries again, backing off: redis-py subscribes every channel again when
  it reconnects. Each join SUBSCRIBEs, even to a channel already subscribed, so that every
  stream waits for a confirmation sent after it joined, as the flow's no-gap rule needs
  (producer/core.py).
- CallBatcher: the calls that streams make in the same turn of the event loop (a worker's step
  nudges many streams at once, and each re-reads its replay stream) go to Redis as one pipeline,
  one round trip instead of one per stream. Each call's replies come back to it alone, its
  errors raised or returned as it asked. Transactions, calls of one command and those that wait for a replica go out on their own.
"""

from __future__ import annotations

import asyncio
import contextlib

import redis
import redis.asyncio

from producer.client import queued, reachable
from producer.connect import REDIS_FAILURES, UNREACHABLE
from producer.core import Call

MESSAGE_TYPES = ("message", "subscribe", "smessage", "ssubscribe", "unsubscribe", "sunsubscribe")
READ_WAIT_S = 1.0  # the single node's reader's wait for a message (a cluster's readers block: _next)
RETRY_S, MAX_RETRY_S = 0.1, 2.0  # the reader's wait after a lost connection, doubling while it stays lost


class ChannelListener:
    """One stream's view of the shared connection: the operations a flow's Subscribe and Listen
    need (the names and arguments of redis-py's PubSub)."""

    def __init__(self, shared: SharedSubscription) -> None:
        self.shared = shared
        self.channel: str | None = None
        self.messages: asyncio.Queue[dict] = asyncio.Queue()
        self.lost: BaseException | None = None  # the connection was lost since the last get_message
        self.woken = asyncio.Event()

    def deliver(self, message: dict) -> None:
        self.messages.put_nowait(message)
        self.woken.set()

    def disconnected(self, error: BaseException) -> None:
        self.lost = error
        self.woken.set()

    async def subscribe(self, channel: str, fresh: bool = False) -> None:
        await self.shared.join(self, channel, fresh)

    async def get_message(self, ignore_subscribe_messages: bool = False, timeout: float = 0.0) -> dict | None:
        """The next message within `timeout` s, or None; raises the error of a connection lost since."""
        loop = asyncio.get_running_loop()
        until = loop.time() + timeout
        while True:
            if self.lost is not None:
                error, self.lost = self.lost, None
                raise error
            while not self.messages.empty():
                message = self.messages.get_nowait()
                if not (ignore_subscribe_messages and message["type"] in ("subscribe", "ssubscribe")):
                    return message
            left = until - loop.time()
            if left <= 0:
                return None
            self.woken.clear()
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(left):
                    await self.woken.wait()

    async def aclose(self) -> None:
        if self.channel is not None:
            await self.shared.leave(self, self.channel)


class SharedSubscription:
    """On one node: one subscribed connection and one reader. On a cluster (`sharded`): SSUBSCRIBE
    through redis-py's cluster pub/sub, which holds a connection to each node that owns a channel
    followed, and one reader per such node (a reader waiting on one node must not delay another's).

    Only a connection's reader reads from it, and it alone reconnects it (redis-py subscribes every
    channel again then): a (un)subscribe only writes, and is refused (ConnectionError, which the
    stream retries) while its connection is down, since making one would read its handshake beside
    the reader. The listener client has no health checks for the same reason (a PING's reply read
    by the one who sent it); TCP keepalive finds a silent peer."""

    def __init__(self, client, sharded: bool = False) -> None:
        self.client, self.sharded = client, sharded
        self.pubsub = client.pubsub()
        self.listeners: dict[bytes, set[ChannelListener]] = {}
        self.commands = asyncio.Lock()  # one (UN)SUBSCRIBE at a time on a connection
        self.readers: dict[str | None, asyncio.Task] = {}  # by node name (None: the one node)

    def listener(self) -> ChannelListener:
        return ChannelListener(self)

    async def join(self, listener: ChannelListener, channel: str, fresh: bool = False) -> None:
        """`fresh`: the connection `channel` goes on left a subscription unconfirmed (it is silent):
        dropped first, so that its reader connects again (every listener on it subscribes again)."""
        listener.channel = channel
        self.listeners.setdefault(channel.encode(), set()).add(listener)
        async with self.commands:
            if self.sharded:
                await self.client.initialize()  # its slot map, once (the pub/sub alone does not load it)
            if fresh and (connection := self._connection(channel)) is not None:
                await connection.disconnect()
            self._writable(channel)
            await (self.pubsub.ssubscribe if self.sharded else self.pubsub.subscribe)(channel)
        for node in list(self.pubsub.node_pubsub_mapping) if self.sharded else [None]:
            if node not in self.readers or self.readers[node].done():
                self.readers[node] = asyncio.get_running_loop().create_task(self._read(node))

    async def leave(self, listener: ChannelListener, channel: str) -> None:
        listeners = self.listeners.get(channel.encode())
        if listeners is None:
            return
        listeners.discard(listener)
        if not listeners:
            del self.listeners[channel.encode()]
            # Best effort: one left subscribed by a lost connection is unsubscribed at its next message.
            with contextlib.suppress(redis.RedisError):
                await self._unsubscribe(channel)

    async def _unsubscribe(self, channel: str | bytes) -> None:
        async with self.commands:
            self._writable(channel)
            await (self.pubsub.sunsubscribe if self.sharded else self.pubsub.unsubscribe)(channel)

    def _writable(self, channel: str | bytes) -> None:
        """Raise ConnectionError if the connection `channel` goes on is down (its reader reconnects it)."""
        connection = self._connection(channel)
        if connection is not None and not connection.is_connected:
            raise redis.ConnectionError("the subscribed connection is reconnecting")

    def _connection(self, channel: str | bytes):
        """The subscribed connection `channel` goes on, or None if there is none yet."""
        if self.sharded:
            pubsub = self.pubsub.node_pubsub_mapping.get(self.client.get_node_from_key(channel).name)
        else:
            pubsub = self.pubsub
        return pubsub.connection if pubsub is not None else None

    async def _next(self, node: str | None) -> dict | None:
        if node is None:
            return await self.pubsub.get_message(timeout=READ_WAIT_S)
        pubsub = self.pubsub.node_pubsub_mapping.get(node)
        if pubsub is None or pubsub.connection is None:  # its first SSUBSCRIBE under way: a read would return at once
            await asyncio.sleep(RETRY_S)
            return None
        # A node's reader blocks until a message comes: redis-py holds the node's I/O lock through a
        # read with a timeout, so every (un)subscribe on the node would wait that read out; a blocking
        # read takes no lock. Each of our SSUBSCRIBEs and SUNSUBSCRIBEs is confirmed on it, a moved
        # slot's channels are unsubscribed by the server, a lost connection raises: all wake it.
        return await self.pubsub.get_sharded_message(timeout=None, target_node=self.client.get_node(node_name=node))

    async def _read(self, node: str | None) -> None:
        failures = 0
        while self.listeners and (node is None or node in self.pubsub.node_pubsub_mapping):
            try:
                message = await self._next(node)
            except (redis.ConnectionError, redis.TimeoutError) as error:
                for listeners in list(self.listeners.values()):
                    for listener in listeners:
                        listener.disconnected(error)
                failures += 1
                await asyncio.sleep(min(MAX_RETRY_S, RETRY_S * 2 ** (failures - 1)))
                continue
            failures = 0
            if message is None or message["type"] not in MESSAGE_TYPES:
                continue
            listeners = self.listeners.get(bytes(message["channel"]))
            if message["type"] in ("unsubscribe", "sunsubscribe"):  # not ours (we leave channels no one
                for listener in listeners or ():                     # follows): the channel's slot moved
                    listener.disconnected(redis.ConnectionError(f"the server ended the subscription to "
                                                                f"{message['channel']!r}"))
                continue
            if listeners is None:
                if message["type"] in ("message", "smessage"):
                    with contextlib.suppress(redis.RedisError):
                        await self._unsubscribe(message["channel"])
                continue
            for listener in listeners:
                listener.deliver(message)

    async def aclose(self) -> None:
        for reader in self.readers.values():
            reader.cancel()
        for reader in self.readers.values():
            with contextlib.suppress(asyncio.CancelledError, redis.RedisError):
                await reader
        await self.pubsub.aclose()


async def direct(client, call: Call) -> list:
    """producer/client.direct, on an asyncio client."""
    [command] = call.commands
    try:
        return [await getattr(client, command.name)(*command.args, **command.kwargs)]
    except redis.ResponseError as error:
        if call.raise_on_error or isinstance(error, UNREACHABLE):
            raise
        return [error]


class CallBatcher:
    def __init__(self, client: redis.asyncio.Redis) -> None:
        self.client = client
        self.waiting: list[tuple[Call, asyncio.Future]] = []
        self.flushes: set[asyncio.Task] = set()

    async def execute(self, call: Call) -> list:
        if len(call.commands) == 1 and not call.replicated:
            return await direct(self.client, call)
        if call.transaction or call.replicated:
            replies = await queued(self.client, call).execute(raise_on_error=call.raise_on_error)
            return reachable(replies[:len(call.commands)])
        future = asyncio.get_running_loop().create_future()
        self.waiting.append((call, future))
        if len(self.waiting) == 1:  # the first of this turn's calls: the rest join it before it goes
            flush = asyncio.get_running_loop().create_task(self._flush())
            self.flushes.add(flush)
            flush.add_done_callback(self.flushes.discard)
        return await future

    async def _flush(self) -> None:
        batch, self.waiting = self.waiting, []
        try:
            together = Call(tuple(command for call, _ in batch for command in call.commands))
            replies = await queued(self.client, together).execute(raise_on_error=False)
            reachable(replies)
        except REDIS_FAILURES as error:  # the connection: every call fails with it
            for _, future in batch:
                if not future.done():
                    future.set_exception(error)
            return
        start = 0
        for call, future in batch:
            mine = replies[start:start + len(call.commands)]
            start += len(call.commands)
            if future.done():  # its stream was cancelled meanwhile
                continue
            error = next((reply for reply in mine if isinstance(reply, Exception)), None)
            if call.raise_on_error and error is not None:
                future.set_exception(error)
            else:
                future.set_result(mine)

