"""producer/rq_jobs.py: rq jobs over streambatch, with rq and streambatch on the private
redis-server. Jobs run in rq's SimpleWorker in this process (burst mode), or in a real
streambatch-rq-worker process where the work horse must be a process of its own (stop, SIGTERM); the fake
worker of fake_worker.py serves them, and in the last test the streambatch worker on the tiny
model does."""

import json
import signal
import subprocess
import sys
from pathlib import Path

import msgspec
import pytest
import redis
from rq import Queue, Retry, SimpleWorker
from rq.command import send_stop_job_command
from rq.job import JobStatus
from rq.serializers import JSONSerializer

from producer import Producer, rq_jobs
from producer.rq_worker import PromptStop
from producer.protocol import LANES, Keys
from tests.producer.fake_worker import running
from tests.worker.conftest import greedy, make_worker, model, offline, prompts_of, run_until  # noqa: F401 (fixtures)
from tests.waiting import wait_for

SCRIPT = Path(sys.prefix) / "bin" / "streambatch-rq-worker"
KEYS = Keys("sb")
COMPLETION_KEYS = {"id", "text", "token_ids", "finish_reason", "usage", "timings", "error", "logprobs", "attempts"}


@pytest.fixture(autouse=True)
def batch_dir(tmp_path, monkeypatch):
    """The rq workers' batch directory ($STREAMBATCH_BATCH_DIR, inherited by an `rq worker`
    process too): the test's tmp_path, where its batch files are."""
    monkeypatch.setenv(rq_jobs.BATCH_DIR_ENV, str(tmp_path))
    return tmp_path


@pytest.fixture
def client(redis_url):
    connection = redis.Redis.from_url(redis_url)
    yield connection
    connection.close()


@pytest.fixture
def queue(client):
    return Queue("llm", connection=client, serializer=JSONSerializer)


class InProcessWorker(PromptStop, SimpleWorker):
    """rq's SimpleWorker, that ends as soon as it is done."""


def work(queue: Queue, max_jobs: int | None = None) -> None:
    """Run the queued jobs here until the queue is empty (or `max_jobs` of them), leaving this
    process's signal handlers as they were (the worker installs its own)."""
    handlers = {number: signal.getsignal(number) for number in (signal.SIGINT, signal.SIGTERM)}
    try:
        InProcessWorker([queue], connection=queue.connection, serializer=JSONSerializer).work(burst=True,
                                                                                               max_jobs=max_jobs)
    finally:
        for number, handler in handlers.items():
            signal.signal(number, handler)


def enqueued(client) -> int:
    """Requests ever added to the lane streams (the fake worker deletes the entries it serves)."""
    return sum(client.xinfo_stream(KEYS.requests(lane))["entries-added"] for lane in LANES
               if client.exists(KEYS.requests(lane)))


def write_lines(path: Path, lines: list) -> str:
    path.write_text("".join((line if isinstance(line, str) else json.dumps(line)) + "\n" for line in lines))
    return str(path)


def read_results(path: str) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text().splitlines()]


def test_generate_returns_the_completion_as_a_plain_dict(queue, redis_url):
    job = queue.enqueue(rq_jobs.generate, "hello rq world", params={"max_tokens": 8})
    with running(redis_url):
        work(queue)
    result = job.return_value(refresh=True)  # stored and read back through the JSON serializer
    assert set(result) == COMPLETION_KEYS
    assert (result["id"], job.get_meta()["request_id"]) == (f"rq-{job.id}", f"rq-{job.id}")
    assert (result["text"], result["token_ids"], result["finish_reason"]) == ("hello rq world ", [0, 1, 2], "stop")
    assert result["usage"] == {"prompt_tokens": 3, "completion_tokens": 3, "cached_tokens": 0}
    assert set(result["timings"]) >= {"queued", "ttft", "total"} and result["error"] is None


def test_a_job_that_fails_for_good_cancels_its_request(queue, client):
    job = queue.enqueue(rq_jobs.generate, "never served", job_timeout=1)  # no streambatch worker runs
    work(queue)
    assert job.get_status(refresh=True) == JobStatus.FAILED
    assert "JobTimeoutException" in job.latest_result().exc_string
    assert enqueued(client) == 1 and client.exists(KEYS.cancelled(f"rq-{job.id}"))


def test_a_job_rq_will_retry_leaves_its_request_to_the_next_attempt_which_follows_it(queue, client, redis_url):
    job = queue.enqueue(rq_jobs.generate, "second time lucky", job_timeout=1, retry=Retry(max=1))
    work(queue, max_jobs=1)  # the first attempt times out: no streambatch worker yet
    assert job.get_status(refresh=True) == JobStatus.QUEUED
    assert enqueued(client) == 1 and not client.exists(KEYS.cancelled(f"rq-{job.id}"))
    with running(redis_url):
        work(queue)
    assert job.return_value(refresh=True)["text"] == "second time lucky "
    assert enqueued(client) == 1


def test_batch_writes_the_results_in_input_order_and_its_progress(queue, redis_url, tmp_path):
    with Producer(redis_url) as producer, running(redis_url):  # line 2's request finished before the batch
        producer.submit("my own id", request_id="mine").result(timeout=10)
    source = write_lines(tmp_path / "in.jsonl", [
        {"prompt": "served last", "lane": "normal"},
        {"prompt": "my own id", "request_id": "mine"},
        "",
        "not json",
        {"prompt_ids": [5, 6, 7], "params": {"max_tokens": 2}},
        {"prompt": "hi", "colour": "red"},
    ])
    output = str(tmp_path / "out.jsonl")
    job = queue.enqueue(rq_jobs.batch, source, output)
    with running(redis_url):
        work(queue)
    assert job.return_value(refresh=True) == {"total": 5, "errors": 2}
    assert job.get_meta() == {"done": 5, "total": 5}
    results = read_results(output)
    assert [result["id"] for result in results] == [f"rq-{job.id}_1", "mine", f"rq-{job.id}_4", f"rq-{job.id}_5",
                                                    f"rq-{job.id}_6"]
    assert [(result["text"], result["finish_reason"]) for result in results] == [
        ("served last ", "stop"), ("my own id ", "stop"), ("", "error"), ("5 6 ", "length"), ("", "error")]
    assert results[2]["error"].startswith("invalid_request: JSON is malformed")
    assert results[4]["error"] == "invalid_request: invalid request: unknown keys ['colour']"
    assert all(set(result) == COMPLETION_KEYS for result in results)
    assert not Path(f"{output}.partial").exists()


def test_a_retried_batch_enqueues_nothing_twice(queue, client, redis_url, tmp_path):
    source = write_lines(tmp_path / "in.jsonl", [{"prompt": f"line {i}"} for i in range(3)])
    output = str(tmp_path / "out.jsonl")
    job = queue.enqueue(rq_jobs.batch, source, output, job_timeout=1, retry=Retry(max=1))
    work(queue, max_jobs=1)  # the first attempt submits all three, then times out waiting
    assert job.get_status(refresh=True) == JobStatus.QUEUED and job.get_meta() == {"done": 0, "total": 3}
    assert enqueued(client) == 3
    assert not any(client.exists(KEYS.cancelled(f"rq-{job.id}_{n}")) for n in (1, 2, 3))
    with running(redis_url):
        work(queue)
    assert [result["text"] for result in read_results(output)] == ["line 0 ", "line 1 ", "line 2 "]
    assert enqueued(client) == 3 and job.get_meta() == {"done": 3, "total": 3}


def test_a_request_id_is_the_job_id_or_its_hash_and_never_collides_with_a_batch_line():
    assert rq_jobs.job_request_id("0b0f1c52-6d0e-4c44-9a69-2f8b6f0c7f11") == "rq-0b0f1c52-6d0e-4c44-9a69-2f8b6f0c7f11"
    # Verbatim, "report_7" would be line 7 of job "report"; hashed, it is the same in every process.
    assert rq_jobs.job_request_id("report_7") == "rq-1ffdc84dd93ef7fbfa42a12f6223902641cf433e"
    assert len(rq_jobs.job_request_id("x" * 41)) == 43  # too long to keep


@pytest.mark.parametrize("url", ["redis://127.0.0.1:6380/2", "redis://:p%40ss@host:6379/0",
                                 "rediss://me:secret@host:6390/1", "unix:///tmp/redis.sock?db=3",
                                 "redis://[::1]:6379/0"])
def test_the_url_of_a_connection_reaches_the_same_server(url):
    def where(connection):
        pool = connection.connection_pool
        keys = ("host", "port", "path", "db", "username", "password")
        return (pool.connection_class, *(pool.connection_kwargs.get(key) for key in keys))

    connection = redis.Redis.from_url(url)
    assert where(redis.Redis.from_url(rq_jobs.redis_url(connection))) == where(connection)


# --- a real `rq worker` process -------------------------------------------------------------


@pytest.fixture
def rq_worker(redis_url, tmp_path, launch):
    """Starts `streambatch-rq-worker llm --burst`, tmp_path its batch directory: it exits once the
    queue is empty."""
    def start() -> subprocess.Popen:
        return launch([str(SCRIPT), "llm", "--burst", "--url", redis_url, "--batch-dir", str(tmp_path)],
                      tmp_path / "rq.log")

    return start


def finished(process: subprocess.Popen, log: Path) -> None:
    try:
        status = process.wait(timeout=60)
    except subprocess.TimeoutExpired:
        raise AssertionError(f"the rq worker still runs after 60 s; its log:\n{log.read_text()}") from None
    assert status == 0, log.read_text()


def test_stopping_a_job_cancels_its_requests(queue, client, rq_worker, tmp_path):
    job = queue.enqueue(rq_jobs.generate, "never served", on_stopped=rq_jobs.CANCEL_ON_STOP)
    source = write_lines(tmp_path / "in.jsonl", [{"prompt": "a"}, {"prompt": "b", "request_id": "named"}])
    batch = queue.enqueue(rq_jobs.batch, source, str(tmp_path / "out.jsonl"), on_stopped=rq_jobs.CANCEL_ON_STOP)
    process = rq_worker()
    for stopped, request_ids in ((job, [f"rq-{job.id}"]), (batch, [f"rq-{batch.id}_1", "named"])):
        wait_for(lambda: all(client.exists(KEYS.submitted(request_id)) for request_id in request_ids))
        send_stop_job_command(client, stopped.id, serializer=JSONSerializer)
        wait_for(lambda: stopped.get_status(refresh=True) == JobStatus.STOPPED)
        assert all(client.exists(KEYS.cancelled(request_id)) for request_id in request_ids)
    finished(process, tmp_path / "rq.log")


def test_sigterm_to_the_work_horse_cancels_its_request(queue, client, rq_worker, tmp_path):
    job = queue.enqueue(rq_jobs.generate, "never served")
    process = rq_worker()
    wait_for(lambda: client.exists(KEYS.submitted(f"rq-{job.id}")))
    [horse] = Path(f"/proc/{process.pid}/task/{process.pid}/children").read_text().split()
    subprocess.run(["kill", "-TERM", horse], check=True)
    finished(process, tmp_path / "rq.log")
    assert job.get_status(refresh=True) == JobStatus.FAILED and "Terminated" in job.latest_result().exc_string
    assert client.exists(KEYS.cancelled(f"rq-{job.id}"))


def test_end_to_end_rq_worker_and_streambatch_worker_on_the_tiny_model(  # noqa: F811 (fixtures)
        queue, make_worker, model, rq_worker, tmp_path):
    prompts, params = prompts_of(4, seed=5), [greedy(3 + i) for i in range(4)]
    single = queue.enqueue(rq_jobs.generate, prompt_ids=prompts[0], params=msgspec.to_builtins(params[0]))
    source = write_lines(tmp_path / "in.jsonl", [{"prompt_ids": prompt, "params": msgspec.to_builtins(request_params)}
                                                 for prompt, request_params in zip(prompts[1:], params[1:])])
    batch = queue.enqueue(rq_jobs.batch, source, str(tmp_path / "out.jsonl"))
    process = rq_worker()
    run_until([make_worker()], lambda: process.poll() is not None, timeout=90)
    finished(process, tmp_path / "rq.log")
    expected = offline(model, prompts, params)
    result = single.return_value(refresh=True)
    assert (result["token_ids"], result["finish_reason"]) == (expected[0], "length")
    assert batch.return_value(refresh=True) == {"total": 3, "errors": 0}
    assert [result["token_ids"] for result in read_results(str(tmp_path / "out.jsonl"))] == expected[1:]
