"""On a cluster: blocking reads of the lane streams while a step runs (step_intake.py), one per
stream, since an XREADGROUP reads one slot's streams and a connection blocked in one serves
nothing else.

Each stream has a connection of its own, taken from its node's pool and kept, its CLIENT ID known
for the CLIENT UNBLOCK that cuts its read short. The reads are sent together and their replies
taken as they come (select), so one thread waits on every node at once, and a wake-up from the
main thread (the step's end) is one more socket in the same select. Redis hands each entry to one
blocked reader, so an enqueue wakes one worker: no herd, unlike the enqueue nudges (nudges.py),
which only idle workers follow.

A stream whose read fails (its slot moved, its node failed over or is gone) is dropped, the slot
map read again, and left alone until the next step, when its connection is taken anew from the
node that then holds it: nothing keeps a node for a slot past one failure. The step's own intake
pass reads that stream meanwhile, and raises what it meets as before.
"""

from __future__ import annotations

import select
import socket
import time
from dataclasses import dataclass

import redis

from producer.connect import REDIS_FAILURES, refresh_slot_map
from producer.protocol import GROUP, REPLY_TIMEOUT_S
from worker.entries import Entry, read_entries

UNBLOCK_RETRY_S = 0.001  # between CLIENT UNBLOCKs sent while a read is about to block


@dataclass
class _Reader:
    """One stream's connection: the node's client (for the CLIENT UNBLOCK), the connection, its id."""

    node: redis.Redis
    connection: redis.connection.AbstractConnection
    client_id: int | None = None
    waiting: bool = False  # a read was sent and its reply not yet taken


class ClusterReads:
    def __init__(self, client: redis.RedisCluster, consumer: str, block_ms: int) -> None:
        self.client, self.consumer, self.block_ms = client, consumer, block_ms
        self.readers: dict[str, _Reader] = {}  # by stream
        self.dropped: set[str] = set()  # streams whose read failed this step
        self._woken, self._wake = socket.socketpair()
        self._woken.setblocking(False)

    def begin(self) -> None:
        """A new step: forget last step's failures and wake-up."""
        self.dropped.clear()
        try:
            while self._woken.recv(64):
                pass
        except BlockingIOError:
            pass

    def wake(self) -> None:
        """From another thread: `read` returns at once (and every one after it, until `begin`)."""
        self._wake.send(b"\0")

    def read(self, streams: list[str], count: int) -> tuple[list[Entry], bool]:
        """A read of up to `count` entries sent on each of `streams` with none waiting, then the
        replies that come within block_ms -> (their entries, whether woken meanwhile)."""
        gone = [stream for stream, reader in self.readers.items() if stream not in streams and not reader.waiting]
        for stream in gone:  # no longer served (a tenant gone, its shards fewer)
            self._drop(stream, refresh=False)
        for stream in streams:
            if stream in self.dropped:
                continue
            reader = self.readers.get(stream) or self._open(stream)
            if reader is not None and not reader.waiting:
                self._send(stream, count)
        waiting = {reader.connection._sock: stream for stream, reader in self.readers.items() if reader.waiting}
        ready, _, _ = select.select([self._woken, *waiting], [], [], self.block_ms / 1000 + REPLY_TIMEOUT_S)
        entries = []
        for sock in ready:
            if sock is not self._woken:
                entries += self._reply(waiting[sock])
        return entries, self._woken in ready

    def waiting_streams(self) -> set[str]:
        """The streams whose reads wait in Redis (or whose replies wait to be taken)."""
        return {stream for stream, reader in self.readers.items() if reader.waiting}

    def cancel(self) -> list[Entry]:
        """Cut every waiting read short -> what they brought meanwhile."""
        entries = []
        for stream, reader in list(self.readers.items()):
            if reader.waiting:
                entries += self._cut_short(stream, reader)
        return entries

    def close(self) -> None:
        for stream in list(self.readers):
            self._drop(stream, refresh=False)
        self._woken.close()
        self._wake.close()

    def _open(self, stream: str) -> _Reader | None:
        """A connection of the stream's own to the node that holds it; None if there is none to be had."""
        try:
            node = self.client.get_redis_connection(self.client.get_node_from_key(stream))
            reader = self.readers[stream] = _Reader(node, node.connection_pool.get_connection())
        except REDIS_FAILURES:
            self.dropped.add(stream)
            refresh_slot_map(self.client)
            return None
        return reader

    def _send(self, stream: str, count: int) -> None:
        reader = self.readers[stream]
        try:
            if reader.client_id is None or reader.connection._sock is None:  # (re)connected: a new id
                reader.connection.send_command("CLIENT", "ID")
                reader.client_id = reader.connection.read_response()
            reader.connection.send_command("XREADGROUP", "GROUP", GROUP, self.consumer, "COUNT", count,
                                           "BLOCK", self.block_ms, "STREAMS", stream, ">", check_health=False)
            reader.waiting = True
        except REDIS_FAILURES:
            self._drop(stream)

    def _reply(self, stream: str) -> list[Entry]:
        reader = self.readers[stream]
        reader.waiting = False
        try:
            reply = reader.node.parse_response(reader.connection, "XREADGROUP")
        except REDIS_FAILURES:  # MOVED, the key gone with its slot (UNBLOCKED), a lost node
            self._drop(stream)
            return []
        return read_entries(reply)

    def _cut_short(self, stream: str, reader: _Reader) -> list[Entry]:
        """CLIENT UNBLOCK, sent again until Redis finds the read waiting, unless its reply comes first."""
        deadline = time.monotonic() + REPLY_TIMEOUT_S
        try:
            while not select.select([reader.connection._sock], [], [], 0)[0]:
                if reader.node.client_unblock(reader.client_id):
                    break  # its empty reply is on its way
                if time.monotonic() > deadline:
                    raise redis.TimeoutError("the read was neither answered nor found waiting")
                time.sleep(UNBLOCK_RETRY_S)
        except REDIS_FAILURES:
            self._drop(stream)
            return []
        return self._reply(stream)

    def _drop(self, stream: str, refresh: bool = True) -> None:
        """Disconnect the stream's connection (a read waiting in it ends with it) and give it back."""
        reader = self.readers.pop(stream)
        reader.connection.disconnect()
        reader.node.connection_pool.release(reader.connection)
        self.dropped.add(stream)
        if refresh:
            refresh_slot_map(self.client)
