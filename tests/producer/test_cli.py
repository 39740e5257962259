"""python -m producer, run in-process (main(argv)) against the private server."""

import io
import json
import os
import pathlib
import re
import subprocess
import sys

import pytest
import redis

from producer.cli import main
from producer.protocol import Keys, TokenEvent, TokenLogprob, TopLogprob
from tests.producer.fake_worker import FakeWorker, done, error, running, token

KEYS = Keys("sb")
ROOT = pathlib.Path(__file__).resolve().parents[2]


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


def test_submit_asks_for_logprobs_and_result_and_stream_print_them_per_token(cli, redis_url):
    cli("submit", "x", "--logprobs", "2", "--id", "lp")
    [taken] = FakeWorker(redis_url).take()
    assert taken.request.params.logprobs == 2
    logprobs = [TokenLogprob(-0.105, " blue", [TopLogprob(5, -0.105, " blue"), TopLogprob(9, -2.5, " [red]")]),
                TokenLogprob(-1.5, "", [TopLogprob(4, -0.5), TopLogprob(6, -1.5)])]  # no tokenizer: ids
    FakeWorker(redis_url).emit("lp", TokenEvent(seq=0, attempt=1, ids=[5, 6], text=" blue", logprobs=logprobs),
                               done(1, completion_tokens=2))
    for command in ("result", "stream"):
        status, out, err = cli(command, "lp")
        assert (status, out) == (0, " blue\n")
        rows = [re.sub("[\u2500-\u257f]", " ", line).split() for line in err.splitlines()]  # no box lines
        assert ["#", "token", "id", "logprob", "top", "2"] in rows
        first = rows.index(["0", "'", "blue'", "5", "-0.105", "'", "blue'", "-0.105"])  # alternatives: a line each
        assert rows[first + 1] == ["'", "[red]'", "-2.500"]
        second = rows.index(["1", "#6", "6", "-1.500", "#4", "-0.500"])
        assert rows[second + 1] == ["#6", "-1.500"]
    status, out, _ = cli("result", "lp", "--json")
    assert json.loads(out)["logprobs"] == [
        {"logprob": -0.105, "text": " blue", "top": [[5, -0.105, " blue"], [9, -2.5, " [red]"]]},
        {"logprob": -1.5, "top": [[4, -0.5, ""], [6, -1.5, ""]]}]


def one_error_line(err: str) -> str:
    """The CLI's whole complaint: one `error:` line (wrapped by the console), no traceback."""
    assert err.startswith("error: ") and "Traceback" not in err, err
    return " ".join(err.split())


@pytest.mark.parametrize("argv, message", [
    (("submit", "x", "--max-tokens", "99999999999999999999999", "--id", "huge"),
     "max_tokens must be in [1, 1048576], got 99999999999999999999999"),
    (("pin", "huge", "--ids", "1,99999999999999999999999"),
     "invalid request: prompt_ids[1]: 99999999999999999999999 is out of range"),
    (("submit", b"caf\xe9".decode(errors="surrogateescape"), "--id", "latin1"),  # a Latin-1 argv
     r"invalid request: prompt: not valid UTF-8 text: surrogates not allowed (at position 3: '\udce9')"),
    (("submit", "\udce9", "--chat", "--id", "latin1"), "invalid request: messages[0].content: not valid UTF-8"),
    (("pin", "latin1", "--system", "\udce9"), "invalid request: messages[0].content: not valid UTF-8"),
])
def test_unencodable_input_is_one_clear_line_and_leaves_nothing_in_redis(cli, redis_url, argv, message):
    status, out, err = cli(*argv)
    assert status == 1 and out == "" and message in one_error_line(err)
    assert redis.Redis.from_url(redis_url).keys("*") == []  # refused before the id was claimed


def test_a_bad_redis_url_is_one_clear_line(capsys, redis_url):
    assert main(["--redis-url", "foo://x", "stats"]) == 1
    assert "error: bad --redis-url 'foo://x': Redis URL must specify one of the following schemes" in \
        one_error_line(capsys.readouterr().err)
    assert main(["--redis-url", redis_url.rsplit("/", 1)[0] + "/99", "submit", "x"]) == 1  # no DB 99
    assert "refused: DB index is out of range" in one_error_line(capsys.readouterr().err)
    with pytest.raises(SystemExit) as exited:  # a non-UTF-8 URL or prefix: a bad command line
        main(["--redis-url", redis_url, "--prefix", "\udcff", "stats"])
    assert exited.value.code == 2 and "argument --prefix: not valid UTF-8: '\\udcff'" in capsys.readouterr().err


@pytest.mark.parametrize("argv", [("stats",), ("submit", "x"), ("pins",), ("cancel", "some-id")])
def test_an_unreachable_redis_is_one_clear_line_for_every_command(capsys, argv):
    assert main(["--redis-url", "redis://127.0.0.1:1/0", *argv]) == 1
    assert "error: cannot reach Redis at redis://127.0.0.1:1/0" in one_error_line(capsys.readouterr().err)


def test_stats_skips_a_worker_key_that_is_not_utf8(cli, redis_url):
    redis.Redis.from_url(redis_url).set(b"sb:worker:\xff", b"x", ex=30)
    FakeWorker(redis_url, name="w-ok").heartbeat()
    status, out, err = cli("stats")
    assert status == 0 and "w-ok" in out and err == ""
    status, out, _ = cli("stats", "--json")
    assert status == 0 and [worker["name"] for worker in json.loads(out)["workers"]] == ["w-ok"]


def test_a_closed_stdout_exits_quietly(redis_url, monkeypatch, capsys):
    class ClosedPipe(io.StringIO):
        def write(self, text):
            raise BrokenPipeError(32, "Broken pipe")
    cli_args = ["--redis-url", redis_url]
    assert main([*cli_args, "pin", "p", "--text", "hi"]) == 0
    capsys.readouterr()
    monkeypatch.setattr(sys, "stdout", ClosedPipe())
    assert main([*cli_args, "pins", "--json"]) == 141
    assert capsys.readouterr().err == ""


def test_a_closed_stdout_pipe_exits_141_without_noise(redis_url):
    """`python -m producer pins --json | head -c0`: the reader is gone before the first write."""
    read_end, write_end = os.pipe()
    os.close(read_end)
    try:
        done = subprocess.run([sys.executable, "-m", "producer", "--redis-url", redis_url, "pins", "--json"],
                              stdout=write_end, stderr=subprocess.PIPE, cwd=ROOT, timeout=60)
    finally:
        os.close(write_end)
    assert (done.returncode, done.stderr) == (141, b"")
