"""worker/cluster_reads.py on a real cluster: one thread's blocking reads of streams on several
nodes at once; an entry goes to one reader of several; a wake-up returns at once; cutting the
reads short leaves nobody blocked; a read sent to a node that no longer holds its stream's slot
drops that stream for the step, and the next step reads it from the node that does."""

import threading
import time

import pytest

from producer.connect import connect
from producer.protocol import GROUP, ensure_group
from worker.cluster_reads import ClusterReads

from .conftest import blocked_clients

STREAMS = ["{a}requests", "{b}requests", "{c}requests"]
BLOCK_MS = 5000


@pytest.fixture
def client(cluster_url):
    client = connect(cluster_url, cluster=True)
    for stream in STREAMS:
        ensure_group(client, stream)
    yield client
    client.close()


@pytest.fixture
def make_reads(client):
    made = []

    def make(consumer: str) -> ClusterReads:
        made.append(ClusterReads(client, consumer, BLOCK_MS))
        return made[-1]

    yield make
    for reads in made:
        reads.close()


def read_in_thread(reads: ClusterReads, count: int = 10) -> tuple[threading.Thread, list]:
    got = []
    thread = threading.Thread(target=lambda: got.append(reads.read(STREAMS, count)))
    thread.start()
    return thread, got


def test_the_streams_nodes_differ(client):
    assert len({client.get_node_from_key(stream).name for stream in STREAMS}) == 3


def test_an_entry_on_any_node_goes_to_one_of_two_readers_at_once(client, make_reads):
    first, second = make_reads("w1"), make_reads("w2")
    reading = [(reads, *read_in_thread(reads)) for reads in (first, second)]
    deadline = time.monotonic() + 10
    while blocked_clients(client) < 6:  # both readers, on all three nodes
        assert time.monotonic() < deadline, "the reads did not all wait"
        time.sleep(0.005)
    sent = time.monotonic()
    entry_id = client.xadd(STREAMS[1], {"n": "1"}).decode()
    while all(thread.is_alive() for _, thread, _ in reading) and time.monotonic() - sent < 2:
        time.sleep(0.005)
    assert time.monotonic() - sent < 1, "the entry came at once, not at the read's timeout"
    [(entries, woken)] = [got[0] for _, thread, got in reading if not thread.is_alive()]
    assert [(entry.stream, entry.entry_id) for entry in entries] == [(STREAMS[1], entry_id)] and not woken

    [still] = [reads for reads, thread, _ in reading if thread.is_alive()]  # the other one waits on
    still.wake()
    for _, thread, got in reading:
        thread.join(5)
    assert [got[0] for reads, _, got in reading if reads is still] == [([], True)]
    assert first.cancel() == [] and second.cancel() == []
    assert blocked_clients(client) == 0


def test_a_wake_up_returns_at_once_and_the_reads_cut_short_leave_nobody_blocked(client, make_reads):
    reads = make_reads("w1")
    thread, got = read_in_thread(reads)
    time.sleep(0.2)
    woken_at = time.monotonic()
    reads.wake()
    thread.join(5)
    assert time.monotonic() - woken_at < 1 and got[0] == ([], True)
    assert reads.cancel() == []
    assert blocked_clients(client) == 0
    reads.begin()  # the next step reads again, its wake-up forgotten
    client.xadd(STREAMS[2], {"n": "2"})
    entries, woken = reads.read(STREAMS, 10)
    assert len(entries) == 1 and not woken


def test_a_read_sent_to_the_wrong_node_drops_its_stream_until_the_next_step(client, make_reads, monkeypatch):
    reads = make_reads("w1")
    right = client.get_node_from_key(STREAMS[0])
    wrong = next(node for node in client.get_primaries() if node.name != right.name)
    monkeypatch.setattr(client, "get_node_from_key", lambda key: wrong)
    client.xadd(STREAMS[0], {"n": "3"})
    entries, _ = reads.read(STREAMS[:1], 10)  # MOVED
    assert entries == [] and reads.dropped == {STREAMS[0]} and STREAMS[0] not in reads.readers
    monkeypatch.undo()

    reads.begin()
    entries, woken = reads.read(STREAMS[:1], 10)
    assert [entry.fields for entry in entries] == [{b"n": b"3"}] and not woken
    assert client.xpending(STREAMS[0], GROUP)["pending"] == 1
