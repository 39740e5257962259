"""Intake overlapped with the engine's step: a request that arrives while a step runs is read and
claimed meanwhile, by a thread of its own, and starts as the step ends, rather than being read
after the step and the turn's writes, at the cost of two more round trips on the turn's path.

While a step runs (and only then) the thread makes the turn's intake pass (Intake.take: the
tenants' shares, the probe for quiet tenants) and then, on one node with room left, a blocking
read of every lane stream, which returns as soon as an entry comes (Redis hands each entry to one
blocked reader: no herd) and which the step's end cuts short with CLIENT UNBLOCK; what a read
brings is claimed at once and the thread reads again. An unblocked read takes nothing, so no entry
is left in this worker's pending list unstarted. On a cluster, where no read spans nodes, the
thread waits in a blocking read of each lane stream at once, on connections of their own
(cluster_reads.py), and the step's end wakes it. There the reads still waiting stay waiting into
the next step while the worker has room (a read per stream and an unblock each, every step,
would cost each node's round trips and turns of its event loop that grow with the shards: a
tenant has a shard or two per master); an entry one brings between steps is claimed at the
next step's start, and the next step's pass leaves their streams unread (an entry goes to a
blocked reader first: they have none to give). They are cut short, and what they brought
claimed, once the room is spent, after a failure, and before the worker waits idle or drains
(`stand_down`).

Nothing else uses the intake meanwhile: the main thread is in the engine, and the flights and
engine requests that a claim is checked against are only read. What the thread raises is raised
at the step's end, so a failed pass fails the turn as before, and what it claimed before failing
is taken back by the next housekeeping (claims.py, take back).
"""

from __future__ import annotations

import threading
from collections.abc import Container, Mapping

import redis

from producer.protocol import Lane
from worker.cluster_reads import UNBLOCK_RETRY_S, ClusterReads
from worker.entries import Entry
from worker.intake import Admission, Intake, read_count


class StepIntake:
    def __init__(self, intake: Intake, client, block_ms: int) -> None:
        """`client` sends the CLIENT UNBLOCKs; on one node `intake.blocking` must be a single-connection
        client (its connection's id is what they name). `block_ms` bounds each blocking read all the same."""
        self.intake, self.client, self.block_ms = intake, client, block_ms
        self.blocks = not intake.cluster
        self.cluster_reads = ClusterReads(client, intake.consumer, block_ms) if intake.cluster else None
        self._lock = threading.Lock()
        self._ending = False
        self._blocked = False  # the thread's read is (about to be) waiting in Redis
        self.connection_id: int | None = None
        if self.blocks:
            intake.blocking.connection.register_connect_callback(self._connected)
            self.connection_id = intake.blocking.client_id()

    def _connected(self, connection) -> None:
        """The blocking connection (re)connected: its id changed."""
        connection.send_command("CLIENT", "ID")
        self.connection_id = connection.read_response()

    def start(self, room: int, held: Mapping[str, Entry], in_engine: Container[str],
              waiting: Mapping[Lane, Container[str]]) -> TakeDuringStep:
        """Begin taking requests in (see `Intake.take` for the arguments); `finish` at the step's end."""
        self._ending = False
        if self.cluster_reads is not None:
            self.cluster_reads.begin()
        return TakeDuringStep(self, room, dict(held), in_engine, waiting)

    def end(self, thread: threading.Thread) -> None:
        """Stop the thread: cut its read short if one waits (sent again until Redis finds it waiting,
        should it be about to block), and wait for the claims in progress; the thread has ended
        when this returns or raises."""
        with self._lock:
            self._ending = True
        if self.cluster_reads is not None:
            self.cluster_reads.wake()  # the thread cuts its reads short itself
            thread.join()
            return
        failure = None  # Redis refused the unblock: the read ends by itself (block_ms), then this raises
        while thread.is_alive():
            with self._lock:
                blocked = self._blocked
            if blocked and failure is None and self.connection_id is not None:
                try:
                    if self.client.client_unblock(self.connection_id):
                        break
                except redis.RedisError as error:
                    failure = error
            thread.join(UNBLOCK_RETRY_S)
        thread.join()
        if failure is not None:
            raise failure

    def stand_down(self, held: Mapping[str, Entry], in_engine: Container[str]) -> list[Admission]:
        """Cut short the cluster's reads left waiting -> what they brought meanwhile, claimed: once a
        step's room is spent, and between steps before the worker waits idle or drains (no entry
        may wait in a read that no step takes)."""
        if self.cluster_reads is None:
            return []
        late = self.cluster_reads.cancel()
        return self.intake.admit(late, held, in_engine) if late else []

    def close(self) -> None:
        if self.cluster_reads is not None:
            self.cluster_reads.close()

    def read_blocking(self, room: int) -> list[Entry] | None:
        """A blocking read, or None once the step has ended."""
        with self._lock:
            if self._ending:
                return None
            self._blocked = True
        try:
            return self.intake.read(room, self.block_ms)
        finally:
            with self._lock:
                self._blocked = False


class TakeDuringStep:
    """One step's intake thread; `finish` -> what it admitted, in the order claimed."""

    def __init__(self, owner: StepIntake, room: int, held: dict[str, Entry], in_engine: Container[str],
                 waiting: Mapping[Lane, Container[str]]) -> None:
        self.owner = owner
        self.admitted: list[Admission] = []
        self.failure: BaseException | None = None
        self.thread = threading.Thread(target=self._take, args=(room, held, in_engine, waiting),
                                       name="step-intake", daemon=True)
        self.thread.start()

    def _take(self, room: int, held: dict[str, Entry], in_engine: Container[str],
              waiting: Mapping[Lane, Container[str]]) -> None:
        intake = self.owner.intake
        try:
            reads = self.owner.cluster_reads
            blocked = reads.waiting_streams() if reads is not None else ()
            self._admitted(intake.take(room, None, held, in_engine, waiting, blocked), held)
            room -= len(self.admitted)
            if reads is not None:
                self._take_on_cluster(room, held, in_engine)
            while self.owner.blocks and room > 0:
                entries = self.owner.read_blocking(room)
                if entries is None:
                    return
                admitted = self._admitted(intake.admit(entries, held, in_engine), held)
                room -= admitted
        except BaseException as error:  # raised in the main thread at the step's end
            self.failure = error

    def _take_on_cluster(self, room: int, held: dict[str, Entry], in_engine: Container[str]) -> None:
        """Blocking reads of every lane stream until the room is spent or the step ends. Reads still
        waiting at the step's end stay waiting, into the next step, while room is left: a stream
        that brings nothing then costs Redis nothing per step, not a read and a CLIENT UNBLOCK
        each. Once the room is spent (or a read failed) they are cut short, and what they brought
        meanwhile is claimed too (a little past the room, as one node's read of several streams
        may be); the worker cuts them short too before it waits idle or drains (`stand_down`)."""
        intake, reads = self.owner.intake, self.owner.cluster_reads
        woken = False
        try:
            while room > 0 and not woken:
                streams = intake.streams.names
                entries, woken = reads.read(streams, read_count(room, len(streams)))
                if entries:
                    room -= self._admitted(intake.admit(entries, held, in_engine), held)
        except BaseException:  # no read left waiting after a failure (what it brought is then reclaimed)
            reads.cancel()
            raise
        if room <= 0:
            self._admitted(self.owner.stand_down(held, in_engine), held)

    def _admitted(self, admissions: list[Admission], held: dict[str, Entry]) -> int:
        """Keep `admissions`; each is held from now on (a second entry of its id is a duplicate)."""
        self.admitted += admissions
        held.update((admission.name, admission.entry) for admission in admissions)
        return len(admissions)

    def finish(self) -> list[Admission]:
        """End the thread; -> what it admitted. Raises what the thread raised."""
        self.owner.end(self.thread)
        if self.failure is not None:
            raise self.failure
        return self.admitted

