"""Who owns a request's entry, against a real redis-server: a worker restarted under its name (as
compose restarts a container), what a worker reads and holds, the fence across a long stall, and
the refresh and take-back that must never take an entry back from the worker that has it now."""

import time

import pytest
import redis

from producer.protocol import GROUP, ErrorEvent, Request

from .conftest import (
    KEYS,
    assert_numbered,
    backlog,
    greedy,
    is_finished,
    killed,
    offline,
    paced,
    prompts_of,
    replay,
    run_until,
    submit,
    tokens_of,
)

NORMAL = KEYS.requests("normal")


class Died(BaseException):
    """The process ended (kill -9, the OOM killer, a crash in native code): nothing of it runs on."""


def dies_with(worker, request_id: str):
    """`worker`'s process dies whenever a step computes `request_id` (a poison request)."""
    execute = worker.engine.runner.execute

    def execute_or_die(plan):
        if any(seq.request_id == f"{KEYS.tenant}/{request_id}" for seq in plan.scheduled):
            raise Died(f"{request_id} killed the worker")
        return execute(plan)

    worker.engine.runner.execute = execute_or_die
    return worker


def holder(client, entry_id: str) -> str:
    [entry] = client.xpending_range(NORMAL, GROUP, entry_id, entry_id, 1)
    return entry["consumer"].decode()


def test_a_request_that_kills_its_worker_is_dead_lettered_across_restarts_under_one_name(make_worker, client, model):
    """Compose restarts a container with the same hostname (and often PID), so the worker comes back
    under the same name, again and again: every start is a new consumer, and taking over what the
    life before it held counts a delivery, so max_deliveries ends the loop."""
    submit(client, Request(id="poison", prompt_ids=[5, 6, 7], params=greedy(8)))
    peer = make_worker("peer")  # the rest of the fleet
    prompts = prompts_of(4, seed=9)
    consumers, lives = [], 0
    while not is_finished(client, "poison"):
        assert lives < 8, "the poison request went round for ever"
        life = dies_with(make_worker("w1", max_deliveries=3, intake_ahead=1), "poison")
        consumers.append(life.consumer)
        lives += 1
        try:
            run_until([life], lambda: is_finished(client, "poison"), timeout=10)
        except Died:
            killed(life)
        if lives == 1:  # the others arrive once the poison is held: the peer serves them meanwhile
            for i, prompt in enumerate(prompts):
                submit(client, Request(id=f"ok{i}", prompt_ids=prompt, params=greedy(8)))
            run_until([peer], lambda: all(is_finished(client, f"ok{i}") for i in range(4)))

    assert lives == 4 and len(set(consumers)) == 4, "three deliveries died with it; the fourth refused it"
    [event] = replay(client, "poison")
    assert isinstance(event, ErrorEvent) and event.code == "dead_letter"
    assert event.message == "gave up after 4 deliveries"
    [(_, letter)] = client.xrange(KEYS.dead_letters)
    assert letter[b"id"] == b"poison" and letter[b"reason"] == b"gave up after 4 deliveries"
    for i, tokens in enumerate(offline(model, prompts, [greedy(8)] * 4)):
        assert tokens_of(replay(client, f"ok{i}")) == tokens
    assert backlog(client) == 0


def test_a_worker_restarted_under_its_name_takes_over_its_earlier_lifes_requests_at_once(make_worker, client, model):
    """No reclaim threshold to wait out (60 s here): the earlier life is known dead."""
    prompts = prompts_of(3, seed=5)
    for i, prompt in enumerate(prompts):
        submit(client, Request(id=f"r{i}", prompt_ids=prompt, params=greedy(30)))
    first = make_worker("w1")
    run_until([first], lambda: all(len(replay(client, f"r{i}")) >= 5 for i in range(3)))
    killed(first)

    second = make_worker("w1")
    run_until([second], lambda: backlog(client) == 0, timeout=20)
    assert second.metrics.reclaimed._value.get() == 3
    for i, tokens in enumerate(offline(model, prompts, [greedy(30)] * 3)):
        events = replay(client, f"r{i}")
        assert_numbered(events)
        assert tokens_of(events) == tokens and {event.attempt for event in events} == {1, 2}


def test_every_entry_a_worker_reads_is_kept_fresh_so_no_peer_reclaims_it(make_worker, client):
    """An idle worker's blocking read takes up to its room from each lane; an entry it held back
    (pending, but not yet its request) went unrefreshed, and a peer reclaimed it from a live worker."""
    busy = paced(make_worker("w1", intake_ahead=1, reclaim_idle_ms=600,
                             engine_options={"num_blocks": 24, "watermark": 0.5}), step_s=0.02)
    peer = make_worker("w2", reclaim_idle_ms=600)
    # "big" leaves fewer free blocks than the watermark, so nothing more is read while it runs
    submit(client, Request(id="big", prompt_ids=list(range(2, 252)), params=greedy(128)), "fast")
    submit(client, Request(id="small", prompt_ids=[5, 6], params=greedy(3)))
    started = time.monotonic()
    while time.monotonic() - started < 1.5:  # 2.5 reclaim thresholds
        busy.poll()
    assert not is_finished(client, "big"), "the test needs big still running"
    peer.housekeeping()
    assert peer.flights == {} and peer.metrics.reclaimed._value.get() == 0
    pending = client.xpending_range(NORMAL, GROUP, "-", "+", 10)
    assert [(entry["consumer"].decode(), entry["times_delivered"]) for entry in pending] == [(busy.consumer, 1)]
    run_until([busy], lambda: is_finished(client, "small") and is_finished(client, "big"), timeout=30)


def test_the_fence_never_repeats_while_an_entry_is_pending_however_long_its_owner_stalls(make_worker, client):
    """The stall outlasts the replay TTL: the attempt key used to expire with it, the next claim's
    attempt started again at 1, the stalled owner's own, and both wrote."""
    stalled = make_worker("w1", replay_ttl=1, reclaim_idle_ms=600)
    rescuer = make_worker("w2", replay_ttl=1, reclaim_idle_ms=600)
    submit(client, Request(id="r", prompt_ids=[5, 6, 7], params=greedy(60)))
    for _ in range(5):
        stalled.poll()
    time.sleep(1.3)  # past the reclaim threshold and the replay TTL, without a write or a refresh
    run_until([rescuer], lambda: "default/r" in rescuer.flights, timeout=5)
    assert rescuer.flights["default/r"].attempt == 2

    stalled.next_housekeeping = float("inf")  # it wakes straight into a step: the fence must stop it
    stalled.poll()
    assert stalled.flights == {}
    run_until([rescuer], lambda: is_finished(client, "r"))
    events = replay(client, "r")  # the stall outlived the first attempt's events: only the second's
    assert_numbered(events)
    assert {event.attempt for event in events} == {2}


def test_refresh_reports_an_entry_a_peer_took_and_leaves_it_with_the_peer(make_worker, client):
    worker = make_worker("w1")
    submit(client, Request(id="r", prompt_ids=[5, 6, 7], params=greedy(50)))
    worker.poll()
    flight = worker.flights["default/r"]
    assert worker.claims.refresh([flight]) == []
    # A peer's reclaim, its claim not yet run: the group says the peer's, the attempt is still ours.
    client.xclaim(NORMAL, GROUP, "peer.0", 0, [flight.entry.entry_id], justid=True)
    assert worker.claims.refresh([flight]) == [flight]
    assert holder(client, flight.entry.entry_id) == "peer.0"
    # The attempt moved on (the peer's claim ran) while the group still says ours: lost as well.
    client.xclaim(NORMAL, GROUP, worker.consumer, 0, [flight.entry.entry_id], justid=True)
    client.set(KEYS.attempt("r"), f"{flight.attempt + 1} {flight.entry.owner}")
    assert worker.claims.refresh([flight]) == [flight]


def test_take_back_leaves_an_entry_a_peer_took_meanwhile_with_the_peer(make_worker, client, monkeypatch):
    worker = make_worker("w1")
    submit(client, Request(id="r", prompt_ids=[5, 6, 7], params=greedy(50)))
    worker.poll()
    flight = worker.flights["default/r"]
    worker.drop(flight, "a failed turn")  # still ours in the group: to take back
    time.sleep(0.05)
    look = worker.claims.client.xpending_range

    def a_peer_takes_it_right_after_we_look(stream, *args, **kwargs):
        seen = look(stream, *args, **kwargs)
        if stream == NORMAL:
            assert [entry["message_id"].decode() for entry in seen] == [flight.entry.entry_id]
            client.xclaim(NORMAL, GROUP, "peer.0", 0, [flight.entry.entry_id], justid=True)
        return seen

    monkeypatch.setattr(worker.claims.client, "xpending_range", a_peer_takes_it_right_after_we_look)
    assert worker.claims.take_back(set(), room=5) == []
    assert holder(client, flight.entry.entry_id) == "peer.0"
    monkeypatch.undo()
    client.xclaim(NORMAL, GROUP, worker.consumer, 0, [flight.entry.entry_id], justid=True)
    time.sleep(0.05)
    assert [entry.entry_id for entry in worker.claims.take_back(set(), room=5)] == [flight.entry.entry_id]


@pytest.mark.parametrize("damage", ["stream deleted", "group destroyed"])
def test_a_lane_stream_or_its_group_deleted_under_a_worker_is_made_again_and_serving_goes_on(
        make_worker, client, model, damage):
    worker = make_worker()
    submit(client, Request(id="running", prompt_ids=[5, 6, 7], params=greedy(30)))
    run_until([worker], lambda: len(replay(client, "running")) >= 3)
    if damage == "stream deleted":
        client.delete(NORMAL)
    else:
        client.xgroup_destroy(NORMAL, GROUP)
    worker.next_housekeeping = 0.0  # housekeeping first: its group commands meet the missing group
    submit(client, Request(id="after", prompt_ids=[8, 9], params=greedy(5)))
    deadline = time.monotonic() + 20
    while not (is_finished(client, "running") and is_finished(client, "after")):
        assert time.monotonic() < deadline, "the worker stopped serving"
        worker.turn()  # as Worker.run does
        assert worker.failed_turns == 0 and worker.health.redis_error is None
        worker.next_housekeeping = 0.0  # every turn: the refresh after the group is made again too
    for request_id, prompt, params in (("running", [5, 6, 7], greedy(30)), ("after", [8, 9], greedy(5))):
        events = replay(client, request_id)
        assert_numbered(events)
        assert tokens_of(events) == offline(model, [prompt], [params])[0] and {e.attempt for e in events} == {1}
    assert client.xpending(NORMAL, GROUP)["pending"] == 0


def test_a_refused_request_whose_ack_was_lost_is_still_dead_lettered(make_worker, client, monkeypatch):
    """Its error event was written, then the ack's round trip failed: the entry comes back, finished."""
    worker = make_worker()
    monkeypatch.setattr("worker.service.TURN_RETRY_S", 0)
    ack, acks = worker.intake.ack, []

    def lost_once(*args, **kwargs):
        acks.append(1)
        if len(acks) == 1:
            raise redis.ConnectionError("Connection reset by peer")  # after the error event's write
        return ack(*args, **kwargs)

    monkeypatch.setattr(worker.intake, "ack", lost_once)
    submit(client, Request(id="bad", prompt_ids=[5, 99_999], params=greedy(3)))
    run_until([worker], lambda: backlog(client) == 0, survive=True)
    [event] = replay(client, "bad")
    assert isinstance(event, ErrorEvent) and event.code == "invalid_request"
    [(_, letter)] = client.xrange(KEYS.dead_letters)
    assert letter[b"id"] == b"bad" and letter[b"reason"].decode() == event.message


def test_close_lets_go_of_every_redis_connection(make_worker, client):
    before = len(client.client_list())
    worker = make_worker()
    worker.poll()
    assert len(client.client_list()) > before
    worker.close()
    deadline = time.monotonic() + 2
    while len(client.client_list()) > before:
        assert time.monotonic() < deadline, [c["cmd"] for c in client.client_list()]
        time.sleep(0.05)


def test_sigterm_while_redis_is_unreachable_ends_the_worker_within_its_drain_timeout(make_worker, client,
                                                                                      monkeypatch):
    """Every turn fails before the drain's end could be seen: the worker used to wait for Redis until
    the container's stop timeout killed it (compose down stops Redis too)."""
    worker = make_worker(drain_timeout=0.5)
    submit(client, Request(id="held", prompt_ids=[5, 6, 7], params=greedy(50)))
    worker.poll()

    def unreachable():
        raise redis.ConnectionError("Error -2 connecting to redis:6379. Name or service not known.")

    monkeypatch.setattr(worker, "housekeeping", unreachable)
    worker.next_housekeeping = 0.0  # every turn starts with it, and fails
    worker.stop()
    started = time.monotonic()
    while not worker.done:
        assert time.monotonic() - started < 3, "still draining"
        worker.turn()
    assert 0.5 <= time.monotonic() - started < 1.5 and worker.flights == {}
    assert client.xpending(NORMAL, GROUP)["pending"] == 1, "left pending, for a reclaim"
