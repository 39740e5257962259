"""No entry point prints or logs a Redis password: each is run as a process with a password in its
Redis URL (refused by a server without one, or with nothing listening) and all of its output read."""

import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from urllib.parse import urlsplit

import pytest

from ops.demo import free_port
from producer.protocol import PASSWORD_ON_COMMAND_LINE, redacted
from worker.config import password_on_command_line
from tests.conftest import private_redis

ROOT = Path(__file__).resolve().parents[1]
SECRET = "s3cret-pw"


def with_password(url: str, port: int | None = None) -> str:
    parts = urlsplit(url)
    return f"redis://:{SECRET}@{parts.hostname}:{port or parts.port}/0"


@pytest.mark.parametrize("url, shown", [
    (f"redis://:{SECRET}@h:6379/0", "redis://:***@h:6379/0"),
    (f"rediss://user:{SECRET}@h/1", "rediss://user:***@h/1"),
    (f"redis://h/0?password={SECRET}&db=2", "redis://h/0?password=***&db=2"),
    (f"unix:///run/redis.sock?password={SECRET}", "unix:///run/redis.sock?password=***"),
    (f"redis://:{SECRET}@[::1]:6379", "redis://:***@[::1]:6379"),
    ("redis://h:6379/0", "redis://h:6379/0"),
    (f"redis://:{SECRET}@h:[bad/0", "<a Redis URL that does not parse>"),
])
def test_a_url_is_shown_without_its_password(url, shown):
    assert redacted(url) == shown


# argv after `python -m` ({wrong}: a URL with a wrong password for a server that has one,
# {unreachable}: one with a password where nothing listens), and what it must say meanwhile
ENTRY_POINTS = {
    "producer, refused": (["producer", "--redis-url", "{wrong}", "stats"], "refused"),
    "producer, unreachable": (["producer", "--redis-url", "{unreachable}", "stats"], "cannot reach Redis"),
    "producer, bad port": (["producer", "--redis-url", f"redis://:{SECRET}@127.0.0.1:notaport/0", "stats"],
                           "bad --redis-url"),
    "producer, from the variable": (["producer", "stats"], "cannot reach Redis"),
    "producer tenant add": (["producer", "--redis-url", "{wrong}", "tenant", "add", "team-x", "--password-file",
                             "{scratch}/team-x.password"], "refused"),
    "worker, refused": (["worker", "--model", "random:llama", "--redis-url", "{wrong}"], "error"),
    "worker, unreachable": (["worker", "--model", "random:llama", "--redis-url", "{unreachable}"],
                            "worker.waiting_for_redis"),
    "ops.prefixes": (["ops.prefixes", "--redis-url", "{wrong}"], "failed"),
    "ops.load run": (["ops.load", "run", "--redis-url", "{wrong}", "--count", "2"], "failed"),
    "ops.demo": (["ops.demo", "--redis-url", "{wrong}", "--model", "random:llama"], "nothing answers at"),
    "ops.soak": (["ops.soak", "--redis-url", "{wrong}", "--model", "random:llama", "--duration", "1"],
                 "nothing answers at"),
}


@pytest.fixture(scope="module")
def guarded_redis(tmp_path_factory):
    """A redis-server that wants a password (not SECRET)."""
    with private_redis(tmp_path_factory.mktemp("guarded"), password="the-right-one") as (url, _):
        yield url


@pytest.mark.parametrize("name", ENTRY_POINTS)
def test_no_entry_point_prints_the_redis_password(name, guarded_redis, tmp_path):
    """Each runs until it has said what it says of that URL (a tool that goes on to start a private
    deployment is stopped there), and every line it wrote is read."""
    argv, said = ENTRY_POINTS[name]
    urls = {"wrong": with_password(guarded_redis), "unreachable": with_password(guarded_redis, free_port()),
            "scratch": str(tmp_path)}
    command = [sys.executable, "-m", *(arg.format(**urls) for arg in argv)]
    environ = os.environ | {"STREAMBATCH_REDIS_URL": urls["unreachable"], "COLUMNS": "200"}
    process = subprocess.Popen(command, cwd=ROOT, env=environ, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                               text=True)
    lines = []
    timer = threading.Timer(120, process.kill)
    timer.start()
    try:
        for line in process.stdout:
            lines.append(line)
            if said in line and process.poll() is None:
                process.terminate()  # the rest of its output is still read
    finally:
        timer.cancel()
        process.wait()
    output = "".join(lines)
    assert said in output, output[-2000:]
    assert SECRET not in output, output[-2000:]


def test_a_password_kept_in_a_file_reaches_a_guarded_redis_from_the_worker_and_the_cli(guarded_redis, tmp_path):
    """How compose hands the password over (a secret file): never in a URL, the environment or argv."""
    password_file = tmp_path / "redis_password"
    password_file.write_text("the-right-one\n")
    environ = os.environ | {"STREAMBATCH_REDIS_PASSWORD_FILE": str(password_file), "COLUMNS": "200"}
    worker = subprocess.Popen([sys.executable, "-m", "worker", "--model", "random:llama", "--redis-url", guarded_redis,
                               "--name", "guarded", "--heartbeat-interval", "0.3"], cwd=ROOT, env=environ,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 60
        while True:
            stats = subprocess.run([sys.executable, "-m", "producer", "--redis-url", guarded_redis, "stats"], cwd=ROOT,
                                   env=environ, capture_output=True, text=True, timeout=30)
            assert stats.returncode == 0, stats.stderr
            if "guarded" in stats.stdout and "ready" in stats.stdout:
                break
            assert worker.poll() is None and time.monotonic() < deadline, stats.stdout
            time.sleep(0.5)
    finally:
        worker.terminate()
        output, _ = worker.communicate(timeout=30)
    assert worker.returncode == 0, output[-2000:]
    wrong = subprocess.run([sys.executable, "-m", "producer", "--redis-url", guarded_redis, "stats"], cwd=ROOT,
                           env=os.environ | {"COLUMNS": "200"}, capture_output=True, text=True, timeout=30)
    assert wrong.returncode == 1 and "refused" in wrong.stderr  # no password, no entry


def test_a_password_on_the_command_line_is_warned_about_and_one_from_the_environment_is_not(guarded_redis):
    """ps shows every user of the machine a process's arguments: the worker and the CLI say so, once."""
    url = with_password(guarded_redis, free_port())
    assert password_on_command_line(["--redis-url", url]) and not password_on_command_line(["--redis-url", guarded_redis])
    assert not password_on_command_line([])  # the URL from $STREAMBATCH_REDIS_URL: not in argv
    environ = os.environ | {"COLUMNS": "400"}
    flagged = subprocess.run([sys.executable, "-m", "producer", "--redis-url", url, "stats"], cwd=ROOT, env=environ,
                             capture_output=True, text=True, timeout=60)
    from_variable = subprocess.run([sys.executable, "-m", "producer", "stats"], cwd=ROOT, capture_output=True,
                                   env=environ | {"STREAMBATCH_REDIS_URL": url}, text=True, timeout=60)
    assert PASSWORD_ON_COMMAND_LINE in flagged.stderr and SECRET not in flagged.stderr + flagged.stdout
    assert "visible to every user" not in from_variable.stderr and "cannot reach Redis" in from_variable.stderr
    worker = subprocess.Popen([sys.executable, "-m", "worker", "--model", "random:llama", "--redis-url", url], cwd=ROOT,
                              env=environ, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines = []
    try:
        for line in worker.stdout:
            lines.append(line)
            if "worker.waiting_for_redis" in line:
                break
    finally:
        worker.kill()
        worker.wait()
    output = "".join(lines)
    assert "worker.password_on_command_line" in output and SECRET not in output, output[-2000:]
