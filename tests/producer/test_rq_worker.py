"""producer/rq_worker.py and the batch directory of producer/rq_jobs.py, attacked by whoever can
push onto the rq queue: jobs that name other functions, batches that name files outside the
directory. streambatch-rq-worker runs for real, as its console script, on the private
redis-server; the fake worker of fake_worker.py serves the requests."""

import os
import subprocess
from pathlib import Path

import pytest
from rq.callbacks import Callback
from rq.command import send_stop_job_command
from rq.job import JobStatus
from rq.serializers import JSONSerializer

from producer import rq_jobs
from tests.conftest import private_redis
from tests.producer.fake_worker import running
from tests.producer.test_rq_jobs import (KEYS, SCRIPT, client, enqueued, finished, queue,  # noqa: F401 (fixtures)
                                         read_results, write_lines)
from tests.waiting import wait_for

REFUSED_FUNCTION = "UnknownJobFunction: this worker runs only streambatch's rq jobs"
ATTACKER_MODULE = """\
from pathlib import Path

HERE = Path(__file__).parent
(HERE / "imported").touch()


def leave_mark(*args, **kwargs):
    (HERE / "ran").touch()
"""


@pytest.fixture
def batch_dir(tmp_path):
    directory = tmp_path / "batches"
    directory.mkdir()
    return directory


@pytest.fixture
def worker_log(tmp_path):
    return tmp_path / "rq-worker.log"


@pytest.fixture
def safe_worker(redis_url, batch_dir, worker_log, launch, monkeypatch):
    """`safe_worker()` starts `streambatch-rq-worker llm --burst` (it exits once the queue is
    empty) with `batch_dir` as its --batch-dir, or none with batch_dir=None."""
    for name in (rq_jobs.BATCH_DIR_ENV, "STREAMBATCH_REDIS_URL", "STREAMBATCH_REDIS_PASSWORD_FILE"):
        monkeypatch.delenv(name, raising=False)

    def start(batch_dir: Path | None = batch_dir, url: str = redis_url, log: Path = worker_log) -> subprocess.Popen:
        batch_option = ["--batch-dir", str(batch_dir)] if batch_dir else []
        return launch([str(SCRIPT), "llm", "--burst", "--url", url, *batch_option], log)

    return start


@pytest.fixture
def attacker(tmp_path, monkeypatch):
    """A module `attacker` that the rq worker can import (as another team's code on the same
    image): importing it leaves the file `imported` in the directory returned, attacker.leave_mark
    leaves `ran` there; so do the shell commands that the tests enqueue."""
    directory = tmp_path / "attacker"
    directory.mkdir()
    (directory / "attacker.py").write_text(ATTACKER_MODULE)
    monkeypatch.setenv("PYTHONPATH", str(directory), prepend=os.pathsep)
    return directory


def traces(attacker: Path) -> list[str]:
    return sorted(path.name for path in attacker.iterdir() if path.name not in {"attacker.py", "__pycache__"})


def stop(job, client) -> None:
    wait_for(lambda: client.exists(KEYS.submitted(f"rq-{job.id}")))
    send_stop_job_command(client, job.id, serializer=JSONSerializer)
    wait_for(lambda: job.get_status(refresh=True) == JobStatus.STOPPED)


def test_a_job_naming_any_other_function_fails_and_nothing_of_it_runs(queue, safe_worker, worker_log, attacker):
    shell = f"touch {attacker / 'ran-shell'}"
    jobs = [queue.enqueue(subprocess.getoutput, shell), queue.enqueue(os.system, shell),
            queue.enqueue("attacker.leave_mark")]
    finished(safe_worker(), worker_log)
    for job in jobs:
        assert job.get_status(refresh=True) == JobStatus.FAILED
        assert f"{REFUSED_FUNCTION}: {job.func_name!r} is not one of" in job.latest_result().exc_string
    assert traces(attacker) == []  # neither run nor imported


def test_a_callback_naming_any_other_function_fails_its_job_and_does_not_run(
        queue, client, redis_url, safe_worker, worker_log, attacker):
    stopped = queue.enqueue(rq_jobs.generate, "never served", on_stopped=Callback("attacker.leave_mark"))
    timed_out = queue.enqueue(rq_jobs.generate, "not served in time", job_timeout=1,
                              on_failure=Callback("attacker.leave_mark"))
    served = queue.enqueue(rq_jobs.generate, "served", on_success=Callback("attacker.leave_mark"))
    process = safe_worker()
    stop(stopped, client)
    wait_for(lambda: timed_out.get_status(refresh=True) == JobStatus.FAILED)
    with running(redis_url):
        finished(process, worker_log)
    for job in (timed_out, served):
        assert job.get_status(refresh=True) == JobStatus.FAILED
        assert f"{REFUSED_FUNCTION}: 'attacker.leave_mark' is not one of" in job.latest_result().exc_string
    assert f"{REFUSED_FUNCTION}: 'attacker.leave_mark'" in worker_log.read_text()  # the stopped callback's
    assert traces(attacker) == []


def test_batch_paths_outside_the_batch_dir_are_refused_before_anything_is_read_or_written(
        queue, client, redis_url, safe_worker, worker_log, batch_dir, tmp_path):
    outside = tmp_path / "outside"
    outside.mkdir()
    victim = outside / "victim.jsonl"
    victim.write_text("another team's file\n")
    secret = write_lines(outside / "secret.jsonl", [{"prompt": "another team's prompt"}])
    source = write_lines(batch_dir / "in.jsonl", [{"prompt": "mine"}])
    (batch_dir / "link-in.jsonl").symlink_to(secret)
    (batch_dir / "link-out.jsonl").symlink_to(victim)
    attempts = [  # (input, output, the path refused)
        ("/etc/hostname", str(outside / "stolen.jsonl"), "/etc/hostname"),  # absolute, elsewhere
        (source, f"{batch_dir}/../outside/victim.jsonl", f"{batch_dir}/../outside/victim.jsonl"),
        ("in.jsonl", "../outside/victim.jsonl", "../outside/victim.jsonl"),
        ("link-in.jsonl", "out.jsonl", "link-in.jsonl"),  # symlinks in the directory, pointing out
        (source, "link-out.jsonl", "link-out.jsonl"),
    ]
    jobs = [queue.enqueue(rq_jobs.batch, source_path, output_path) for source_path, output_path, _ in attempts]
    with running(redis_url):  # a batch let through would finish, not wait for ever
        finished(safe_worker(), worker_log)
    for job, (_, _, refused) in zip(jobs, attempts):
        assert job.get_status(refresh=True) == JobStatus.FAILED
        assert f"BatchRefused: batch path {refused!r} is outside the batch directory {batch_dir}" in (
            job.latest_result().exc_string)
    assert enqueued(client) == 0  # no line of any input became a request
    assert sorted(path.name for path in outside.iterdir()) == ["secret.jsonl", "victim.jsonl"]
    assert victim.read_text() == "another team's file\n"
    assert sorted(path.name for path in batch_dir.iterdir()) == ["in.jsonl", "link-in.jsonl", "link-out.jsonl"]


def test_streambatch_jobs_run_and_a_link_planted_at_the_partial_output_is_not_written_through(
        queue, client, redis_url, safe_worker, worker_log, batch_dir, tmp_path):
    victim = tmp_path / "victim.jsonl"
    victim.write_text("another team's file\n")
    write_lines(batch_dir / "in.jsonl", [{"prompt": "first line"}, {"prompt": "second line"}])
    (batch_dir / "out.jsonl.partial").symlink_to(victim)  # where batch writes until the output is complete
    stopped = queue.enqueue(rq_jobs.generate, "never served", on_stopped=rq_jobs.CANCEL_ON_STOP)
    batch = queue.enqueue(rq_jobs.batch, str(batch_dir / "in.jsonl"), str(batch_dir / "out.jsonl"))
    single = queue.enqueue(rq_jobs.generate, "hello safe worker")
    process = safe_worker()
    stop(stopped, client)
    assert client.exists(KEYS.cancelled(f"rq-{stopped.id}"))  # CANCEL_ON_STOP ran
    with running(redis_url):
        finished(process, worker_log)
    assert single.return_value(refresh=True)["text"] == "hello safe worker "
    assert batch.return_value(refresh=True) == {"total": 2, "errors": 0}
    assert [result["text"] for result in read_results(batch_dir / "out.jsonl")] == ["first line ", "second line "]
    assert not (batch_dir / "out.jsonl").is_symlink() and not os.path.lexists(batch_dir / "out.jsonl.partial")
    assert victim.read_text() == "another team's file\n"


def test_without_a_batch_dir_every_batch_is_refused(queue, client, redis_url, safe_worker, worker_log, tmp_path):
    source = write_lines(tmp_path / "in.jsonl", [{"prompt": "anywhere"}])
    job = queue.enqueue(rq_jobs.batch, source, str(tmp_path / "out.jsonl"))
    with running(redis_url):
        finished(safe_worker(batch_dir=None), worker_log)
    assert job.get_status(refresh=True) == JobStatus.FAILED
    assert ("BatchRefused: batch jobs are off on this rq worker: it has no batch directory "
            "($STREAMBATCH_BATCH_DIR, streambatch-rq-worker --batch-dir)") in job.latest_result().exc_string
    assert enqueued(client) == 0 and not (tmp_path / "out.jsonl").exists()
    assert "batch directory none (batch jobs refused)" in worker_log.read_text()


def test_the_password_comes_from_its_file_and_is_never_printed(safe_worker, tmp_path, monkeypatch):
    password = "rq-s3cret-pw"
    (tmp_path / "locked").mkdir()
    with private_redis(tmp_path / "locked", password=password) as (url, _):
        password_file = tmp_path / "password"
        password_file.write_text(f"{password}\n")
        monkeypatch.setenv("STREAMBATCH_REDIS_PASSWORD_FILE", str(password_file))
        finished(safe_worker(url=url, log=tmp_path / "from-file.log"), tmp_path / "from-file.log")  # AUTH works
        monkeypatch.delenv("STREAMBATCH_REDIS_PASSWORD_FILE")
        in_url = url.replace("redis://", f"redis://:{password}@")
        finished(safe_worker(url=in_url, log=tmp_path / "in-url.log"), tmp_path / "in-url.log")
    assert f"on {url}," in (tmp_path / "from-file.log").read_text()
    assert f"on {url.replace('redis://', 'redis://:***@')}," in (tmp_path / "in-url.log").read_text()
    assert not any(password in (tmp_path / log).read_text() for log in ("from-file.log", "in-url.log"))
