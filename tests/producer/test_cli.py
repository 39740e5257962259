"""python -m producer, run in-process (main(argv)) against the private server."""

import json

import pytest
import redis

from producer.cli import main
from producer.protocol import Keys
from tests.producer.fake_worker import FakeWorker, done, error, running, token

KEYS = Keys("sb")


@pytest.fixture
def cli(redis_url, capsys):
    def run(*argv):
        status = main(["--redis-url", redis_url, *argv])
        out, err = capsys.readouterr()
        return status, out, err
    return run


def test_submit_prints_the_id_and_enqueues_with_the_flags(cli, redis_url):
    status, out, _ = cli("submit", "hello world", "--max-tokens", "12", "--temperature", "0",
                         "--seed", "5", "--id", "cli-1")
    assert (status, out) == (0, "cli-1\n")
    [taken] = FakeWorker(redis_url).take()
    params = taken.request.params
    assert (taken.lane, taken.request.prompt, params.max_tokens, params.temperature, params.seed) == \
        ("fast", "hello world", 12, 0.0, 5)


def test_submit_stream_prints_text_as_it_arrives(cli, redis_url):
    with running(redis_url):
        status, out, err = cli("submit", "one two three", "--chat", "--stream", "--lane", "normal",
                               "--max-tokens", "16", "--timeout", "20")
    assert (status, out) == (0, "one two three \n")
    assert "normal lane" in err and "[stop · 3 tokens" in err


def test_stream_and_result_of_a_finished_request(cli, redis_url):
    with running(redis_url):
        _, request_id, _ = cli("submit", "alpha beta", "--max-tokens", "1")
        status, out, err = cli("result", request_id.strip(), "--timeout", "20")
    assert (status, out) == (0, "alpha \n") and "[length · 1 tokens" in err
    status, out, _ = cli("stream", request_id.strip(), "--timeout", "5")  # after the end: replayed
    assert (status, out) == (0, "alpha \n")
    status, out, _ = cli("result", request_id.strip(), "--json")
    completion = json.loads(out)
    assert (completion["finish_reason"], completion["token_ids"], completion["usage"]["completion_tokens"]) == \
        ("length", [0], 1)


def test_a_failed_request_exits_1_with_its_error(cli, redis_url):
    cli("submit", "x", "--id", "doomed")
    FakeWorker(redis_url).emit("doomed", token(0, "a"), done(1, reason="error"))
    status, out, err = cli("stream", "doomed")
    assert (status, out) == (1, "a\n") and "[error" in err
    cli("submit", "x", "--id", "refused")
    FakeWorker(redis_url).emit("refused", error(0, "too_long", "[/INST] is 9000 tokens"))
    status, out, err = cli("result", "refused")
    assert (status, out) == (1, "\n") and "error: too_long: [/INST] is 9000 tokens" in err


def test_cancel_and_stats(cli, redis_url):
    assert cli("cancel", "some-id")[0] == 0
    assert redis.Redis.from_url(redis_url).exists(KEYS.cancelled("some-id"))
    cli("submit", "x", "--lane", "normal")
    FakeWorker(redis_url, name="w-7").heartbeat(model="smollm2-135m")
    status, out, _ = cli("stats")
    assert status == 0 and "w-7" in out and "smollm2-135m" in out and "dead letters: 0" in out
    assert "ready" in out and "is starting" not in out
    FakeWorker(redis_url, name="w-8").heartbeat(state="starting", phase="building the native kernels")
    status, out, _ = cli("stats")
    assert "w-8 is starting: building the native kernels" in out
    status, out, _ = cli("stats", "--json")
    stats = json.loads(out)
    assert stats["lanes"]["normal"]["backlog"] == 1
    assert {(worker["name"], worker["state"]) for worker in stats["workers"]} == {("w-7", "ready"), ("w-8", "starting")}


@pytest.mark.parametrize("argv, message", [
    (("submit", "x", "--id", "bad id"), "invalid request: request id must match"),
    (("submit", "x", "--temperature", "-1"), "temperature must be in [0, 100]"),
    (("result", "nobody", "--timeout", "2"), "no request 'nobody'"),
    (("result", "bad/id"), "request id must match [A-Za-z0-9_-]{1,64}, got 'bad/id'"),  # not markup
])
def test_errors_are_one_clear_line_and_exit_1(cli, argv, message):
    status, out, err = cli(*argv)
    assert status == 1 and out == "" and message in " ".join(err.split())


def test_an_unreachable_redis_is_reported(capsys):
    assert main(["--redis-url", "redis://127.0.0.1:1/0", "stats"]) == 1
    assert "cannot reach Redis at redis://127.0.0.1:1/0" in capsys.readouterr().err


def test_ctrl_c_while_streaming_a_submit_cancels_it(cli, redis_url, monkeypatch):
    def interrupted(*args):
        raise KeyboardInterrupt
    monkeypatch.setattr("producer.cli._print_stream", interrupted)
    status, _, err = cli("submit", "x", "--stream", "--id", "abandoned")
    assert status == 130 and "cancelled abandoned" in err
    assert redis.Redis.from_url(redis_url).exists(KEYS.cancelled("abandoned"))
