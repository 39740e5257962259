"""Connections that go silent: a TCP proxy between the worker / producer and Redis stops
forwarding on the connections it has (a half-open connection: a NAT or load balancer that
forgot them), while new connections work. Nobody may hang: the worker drops what it holds,
reconnects and takes its requests back; a consumer's stream reconnects and ends complete."""

import signal
import socket
import threading
import time
from urllib.parse import urlparse

import pytest

from producer import Producer
from producer.protocol import Request

from .conftest import assert_numbered, backlog, greedy, offline, replay, submit, tokens_of


class SilentProxy:
    """Forwards TCP to Redis; `silence()` makes every connection open so far go quiet both ways."""

    def __init__(self, target_url: str) -> None:
        target = urlparse(target_url)
        self.target = (target.hostname, target.port)
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.url = f"redis://127.0.0.1:{self.listener.getsockname()[1]}/0"
        self.generation = 0  # connections of an older generation are silenced
        self.open: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def silence(self) -> None:
        self.generation += 1

    def close(self) -> None:
        self.listener.close()
        for connection in self.open:
            connection.close()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            server = socket.create_connection(self.target)
            self.open += [client, server]
            for source, sink in ((client, server), (server, client)):
                threading.Thread(target=self._pipe, args=(source, sink, self.generation), daemon=True).start()

    def _pipe(self, source: socket.socket, sink: socket.socket, generation: int) -> None:
        try:
            while data := source.recv(65536):
                if generation == self.generation:
                    sink.sendall(data)  # silenced: read and dropped, as a dead path would
        except OSError:
            pass


@pytest.fixture
def proxy(redis_url, monkeypatch):
    monkeypatch.setattr("producer.protocol.REPLY_TIMEOUT_S", 1.0)  # a dead connection shows in 1 s, not 10

    def hung(*_):
        raise TimeoutError("hung on a silent connection")

    previous = signal.signal(signal.SIGALRM, hung)  # a read that never returns fails the test instead
    signal.alarm(60)
    silent = SilentProxy(redis_url)
    yield silent
    silent.close()
    signal.alarm(0)
    signal.signal(signal.SIGALRM, previous)


def test_a_worker_and_a_consumer_on_connections_that_go_silent_recover(proxy, make_worker, client, model):
    worker = make_worker(redis_url=proxy.url, heartbeat_interval=0.3, reclaim_idle_ms=60_000)
    producer = Producer(proxy.url, poll_interval=0.2)
    prompts = [[5, 6, 7], [8, 9, 10, 11]]
    for i, prompt in enumerate(prompts):
        producer.submit(prompt_ids=prompt, params=greedy(60), request_id=f"s{i}")
    streamed = {}
    consumers = [threading.Thread(target=lambda i=i: streamed.__setitem__(i, list(producer.stream(f"s{i}", timeout=60))))
                 for i in range(2)]
    for consumer in consumers:
        consumer.start()
    deadline = time.monotonic() + 60
    while not all(len(replay(client, f"s{i}")) >= 5 for i in range(2)):
        assert time.monotonic() < deadline
        worker.turn()
    proxy.silence()  # every connection so far, the worker's and the consumers', goes quiet
    silenced_at = time.monotonic()
    while backlog(client) or any(consumer.is_alive() for consumer in consumers):
        assert time.monotonic() < deadline, "hung on a silent connection"
        worker.turn()
    assert time.monotonic() - silenced_at < 30

    for i, tokens in enumerate(offline(model, prompts, [greedy(60)] * 2)):
        assert_numbered(replay(client, f"s{i}"))
        assert tokens_of(replay(client, f"s{i}")) == tokens
        assert streamed[i] == replay(client, f"s{i}")  # the consumer: every event once, in order


def test_an_idle_worker_blocked_on_a_silent_connection_recovers(proxy, make_worker, client):
    """The blocking read of an idle worker is the read most likely to sit on a dead connection."""
    worker = make_worker(redis_url=proxy.url, heartbeat_interval=0.3, reclaim_idle_ms=60_000)
    for _ in range(3):
        worker.turn()  # idle: its blocking read is open on the proxied connection
    proxy.silence()
    submit(client, Request(id="after", prompt_ids=[5, 6], params=greedy(4)))
    deadline = time.monotonic() + 30
    while backlog(client):
        assert time.monotonic() < deadline, "hung on a silent connection"
        worker.turn()
