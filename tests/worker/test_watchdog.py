"""A hung step: kept alive up to --stall-timeout, then the worker ends itself (status 70) so that
its requests are reclaimed and a restart policy, which acts on an exit, not on /healthz, acts."""

import os
import threading
import time
from http import HTTPStatus

from producer.protocol import Request
from worker.service import EXIT_STALLED

from .conftest import assert_numbered, greedy, is_finished, replay, run_until, submit


def test_a_step_that_hangs_past_the_stall_timeout_ends_the_worker_and_its_request_is_reclaimed(
        make_worker, client, monkeypatch):
    exits = []
    monkeypatch.setattr(os, "_exit", exits.append)  # the process would end here
    hung = make_worker("w1", stall_timeout=1.0, reclaim_idle_ms=600)
    rescuer = make_worker("w2", reclaim_idle_ms=600)
    submit(client, Request(id="r", prompt_ids=[5, 6, 7], params=greedy(30)))
    hung.poll()
    assert "default/r" in hung.flights
    release, step = threading.Event(), hung.engine.step

    def hangs():
        release.wait(30)
        return step()

    hung.engine.step = hangs
    loop = threading.Thread(target=hung.run)
    loop.start()
    try:
        time.sleep(0.8)  # a long step so far: kept alive
        rescuer.housekeeping()
        assert rescuer.flights == {}
        deadline = time.monotonic() + 5
        while not exits:
            assert time.monotonic() < deadline, "the stalled worker did not end itself"
            time.sleep(0.05)
        assert exits == [EXIT_STALLED] and hung.health.liveness()[0] == HTTPStatus.SERVICE_UNAVAILABLE
        time.sleep(0.7)  # nothing refreshes its entry any more: past the reclaim threshold
        run_until([rescuer], lambda: is_finished(client, "r"))
    finally:
        release.set()
        hung.stop()
        loop.join(timeout=10)
    events = replay(client, "r")
    assert_numbered(events)
    assert events[-1].attempt == 2 and events[-1].usage.completion_tokens == 30
    assert exits == [EXIT_STALLED], "ended once"
