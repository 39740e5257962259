"""ops/demo.py with the fake worker standing in for `python -m worker` (no model), and the
summary arithmetic on its own."""

import io
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import redis
from rich.console import Console

import ops.demo as demo_module
from ops.demo import chosen_prompts, redis_at, run
from ops.demo_view import CHAT_PROMPTS, Watched, panels, summary
from ops.percentile import percentile
from ops.tool import ToolError
from producer import DoneEvent
from producer.protocol import Timings, Usage

ROOT = Path(__file__).resolve().parents[2]
FAKE_WORKER = [sys.executable, str(Path(__file__).with_name("fake_worker.py")), "--step-delay", "0.005"]


def console() -> Console:
    return Console(file=io.StringIO(), width=120)


def test_the_demo_runs_end_to_end_and_cleans_up():
    screen = console()
    starting = [*FAKE_WORKER, "--startup-phase", "building the native kernels", "--startup-phase",
                "loading the model"]
    run(screen, redis_url=None, worker_command=starting, name="demo-test", stall_timeout=30, timeout=60)
    out = screen.file.getvalue()
    # each phase the worker went through, with its time, then ready
    assert re.search(r"(?s)✓ building the native kernels \(0\.\d s\).*✓ loading the model \(0\.\d s\).*"
                     r"demo-test is ready after \d\.\d s", out), out
    assert f"{len(CHAT_PROMPTS)} requests (0 failed)" in out and "tokens/s" in out
    assert "capital · fast" in out and "story · normal" in out  # both lanes, one panel each
    assert "What is the capital of France?" in out  # the fake worker echoes the prompt
    url = re.search(r"private redis-server at (\S+)", out).group(1)
    with pytest.raises(redis.ConnectionError):
        redis.Redis.from_url(url, socket_connect_timeout=1).ping()  # stopped on the way out


def test_sigterm_stops_what_the_demo_started():
    """As Ctrl-C does: `python -m ops.demo` terminated while its worker starts stops its private Redis and
    says 130."""
    demo = subprocess.Popen([sys.executable, "-m", "ops.demo", "--model", "random:llama"], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=os.environ | {"COLUMNS": "200"})
    said, started = [], None
    try:
        for line in demo.stdout:
            said.append(line)
            if started is None and (started := re.search(r"private redis-server at (\S+)", line)):
                demo.terminate()  # the rest of its output is still read
        status = demo.wait(timeout=60)
    finally:
        if demo.poll() is None:
            demo.kill()
    assert started is not None and status == 130, "".join(said)
    with pytest.raises(redis.ConnectionError):
        redis.Redis.from_url(started.group(1), socket_connect_timeout=1).ping()


def test_a_sigterm_while_a_process_starts_stops_it(monkeypatch):
    """The SIGTERM comes just after the fork, before the clean-up has the process: it still stops it, then
    ends the tool as Ctrl-C does."""
    children = []

    def popen_then_sigterm(*args, **kwargs):
        children.append(real_popen(*args, **kwargs))
        os.kill(os.getpid(), signal.SIGTERM)
        return children[-1]

    real_popen = subprocess.Popen
    monkeypatch.setattr(demo_module.subprocess, "Popen", popen_then_sigterm)
    previous = signal.signal(signal.SIGTERM, signal.default_int_handler)  # as run_tool sets it
    try:
        with pytest.raises(KeyboardInterrupt), demo_module.started([sys.executable, "-c", "import time; time.sleep(60)"],
                                                                    grace=5):
            pytest.fail("the block ran despite the SIGTERM")
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert children and children[0].poll() is not None


def test_your_own_prompts_replace_the_demos():
    assert chosen_prompts([], 100) == CHAT_PROMPTS
    screen = console()
    mine = chosen_prompts(["Why is the sky blue today?", "Name three rivers in Europe."], 3)
    run(screen, redis_url=None, worker_command=FAKE_WORKER, name="demo-mine", stall_timeout=30, timeout=60,
        prompts=mine)
    out = screen.file.getvalue()
    assert "submitting 2 prompts" in out and "2 requests (0 failed)" in out
    assert "prompt 1 · " in out and "prompt 2 · " in out and "capital" not in out
    # the fake worker echoes a prompt's words, cut at max_tokens
    assert "│ Why is the " in out and "│ Name three rivers " in out and out.count("length · 3 tokens") == 2


def test_a_worker_that_dies_while_loading_is_reported_with_its_output(redis_url):
    screen = console()
    dying = [sys.executable, "-c", "import sys; print('loading the model'); sys.exit('out of memory')"]
    with pytest.raises(ToolError, match=r"(?s)exited with status 1.*loading the model.*out of memory"):
        run(screen, redis_url=redis_url, worker_command=dying, name="doomed", stall_timeout=30, timeout=5)
    assert f"using {redis_url}" in screen.file.getvalue()  # a Redis that answers is used as is


def test_a_slow_worker_that_shows_progress_is_waited_for(redis_url):
    """Phases longer than the stall timeout, with output as they go, are progress."""
    slow = [*FAKE_WORKER, "--phase-seconds", "2", "--startup-phase", "one", "--startup-phase", "two"]
    screen = console()
    run(screen, redis_url=redis_url, worker_command=slow, name="slow", stall_timeout=1, timeout=60)
    out = screen.file.getvalue()
    # each phase outlasted the stall timeout (the demo sees it start and end at its own polls)
    seen = dict(re.findall(r"✓ (one|two) \((\d+\.\d) s\)", out))
    assert seen.keys() == {"one", "two"} and all(float(s) > 1 for s in seen.values()), out


def test_a_worker_that_makes_no_progress_fails_with_its_output_and_what_to_do(redis_url):
    stuck = [sys.executable, "-c", "import time; print('waiting on something', flush=True); time.sleep(60)"]
    with pytest.raises(ToolError) as failure:
        run(console(), redis_url=redis_url, worker_command=stuck, name="quiet", stall_timeout=1, timeout=5)
    message = str(failure.value)
    assert "made no progress for 1 s (still 'starting (importing torch)')" in message
    assert "waiting on something" in message and "make setup" in message
    kept = Path(re.search(r"whole log: (\S+)", message).group(1))
    assert "waiting on something" in kept.read_text()


def test_nothing_at_the_url_means_a_private_server(tmp_path):
    screen = console()
    with redis_at("redis://127.0.0.1:1/0", tmp_path, screen) as url:
        assert url != "redis://127.0.0.1:1/0" and redis.Redis.from_url(url).ping()
    assert "nothing answers at redis://127.0.0.1:1/0" in screen.file.getvalue()


def test_summary_numbers():
    done = DoneEvent(seq=3, attempt=1, finish_reason="stop", usage=Usage(3, 3), timings=Timings(0.1, 0.2, 0.5))
    fast = Watched("a", "fast", submitted=0.0, arrivals=[(0.2, 1), (0.3, 1), (0.5, 2)], end=done)
    slow = Watched("b", "normal", submitted=0.0, arrivals=[(1.0, 1)], end=None)  # never finished
    assert fast.tokens == 4 and fast.ttft == 0.2
    assert fast.inter_token_latencies == pytest.approx([0.1, 0.1])
    assert percentile([3, 1, 2], 0.5) == 2 and percentile([], 0.9) is None
    hundred = list(range(1, 101))
    assert (percentile(hundred, 0.99), percentile(hundred, 0.5), percentile(hundred, 1.0)) == (99, 50, 100)
    screen = console()
    screen.print(summary([fast, slow], wall=2.0))
    out = screen.file.getvalue()
    assert "2 requests (1 failed), 5 tokens in 2.0 s: 2.5 tokens/s" in out
    assert re.search(r"TTFT \(s\)\s+│\s+0\.200\s+│\s+1\.000\s+│\s+1\.000", out)  # P50 of two: the lower
    assert re.search(r"inter-token latency \(ms\)\s+│\s+100\.0", out)


def test_panels_show_model_output_verbatim_and_crop_to_the_tail():
    seen = Watched("odd", "fast", submitted=0.0, text="[/INST] [bold]x\n" + "line\n" * 20 + "last words")
    screen = console()
    screen.print(panels([seen]))
    assert "[/INST] [bold]x" in screen.file.getvalue()  # not taken for rich markup
    screen = console()
    screen.print(panels([seen], crop=(3, 60)))
    assert "…line" in screen.file.getvalue() and "last words" in screen.file.getvalue()
    assert "INST" not in screen.file.getvalue()


def test_the_demo_ends_with_a_request_through_the_openai_gateway():
    screen = console()
    run(screen, redis_url=None, worker_command=FAKE_WORKER, name="demo-gateway", stall_timeout=30, timeout=60,
        prompts=chosen_prompts(["Why is the sky blue today?"], 3), gateway=True)
    out = screen.file.getvalue()
    # the fake worker echoes the prompt's words
    assert re.search(r"gateway: http://127\.0\.0\.1:\d+/v1 answered 'Say hello in French\.' with 'Say hello in", out), out
    assert "/v1/chat/completions -H 'Content-Type: application/json'" in out and 'OpenAI(base_url="http' in out
