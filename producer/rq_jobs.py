"""rq (python-rq) jobs that run streambatch requests, for backends already on rq: a job submits
through the Producer, waits for the end, and returns the Completion as plain JSON.

JSON serializer only, never pickle, on the queue and on the worker; the jobs take and return
JSON types only:

    from redis import Redis
    from rq import Queue, Retry
    from rq.serializers import JSONSerializer
    from producer import rq_jobs

    queue = Queue("llm", connection=Redis.from_url("redis://redis:6379/0"), serializer=JSONSerializer)
    job = queue.enqueue(rq_jobs.generate, "Why is the sky blue?", params={"max_tokens": 64},
                        on_stopped=rq_jobs.CANCEL_ON_STOP, retry=Retry(max=2))
    job.latest_result(timeout=60).return_value  # {"text": ..., "finish_reason": "stop", "usage": {...}, ...}
    queue.enqueue(rq_jobs.batch, "in.jsonl", "out.jsonl", on_stopped=rq_jobs.CANCEL_ON_STOP)

    $ streambatch-rq-worker llm --url redis://redis:6379/0 --batch-dir /data/batches

rq queues are per team. rq has no access control of its own: whoever can write rq's keys
(`rq:*`) in a Redis database can enqueue any function on every queue there, and a plain
`rq worker` imports and runs it (`subprocess.getoutput`, `os.system`). So each team's rq lives
in a Redis database of its own, reached only by that team's ACL user: Redis ACLs grant keys,
not databases, so no other team's user may both SELECT that database and write `rq:*` (a server
of its own is simplest). The streambatch tenant users of producer/acl.py deliberately cannot
touch rq's keys: they are no way onto a queue. Jobs on another database or server than
streambatch's name it with `url=`. streambatch-rq-worker (producer/rq_worker.py) runs these
jobs and refuses every other function; it always uses the JSON serializer.

Batch files live in one directory, the rq worker's batch directory (`$STREAMBATCH_BATCH_DIR`,
which streambatch-rq-worker sets from `--batch-dir`): a batch's two paths are relative to it, or
absolute inside it, and one that resolves outside it (an absolute path elsewhere, `..`, a
symlink that points out) is refused before any file is opened. A worker without a batch
directory refuses every batch. The output is written as a new file, never through a link
planted at its path.

Which Redis: a job reaches streambatch on the server its rq worker uses (the job's own
connection), unless given `url=`: another server, TLS with certificate options, Sentinel, or a
node of a Redis Cluster (rq itself runs on one node; the rq worker then runs with
`--redis-cluster`, and every job must name the cluster with `url=`). `prefix=` must match the streambatch workers' prefix. The tenant is the rq worker's
`$STREAMBATCH_TENANT` (else `default`), never a job argument: whoever enqueues a job cannot
choose to act for another team.

Request ids come from the rq job id: `rq-<job id>`, and for batch line n `rq-<job id>_<n>`
unless the line names its own. A retried job (rq's Retry, a requeue) finds the requests its
earlier attempt enqueued and follows them; it enqueues nothing twice.

A job that ends for good cancels its requests: when it raises with no retry left (its own
error, rq's job timeout, SIGTERM to the work horse), or when it is stopped (rq's stop-job
command: the worker SIGKILLs the work horse, so the cancel falls to the CANCEL_ON_STOP
callback, which the worker runs afterwards). A job that will be retried leaves its requests
running for the next attempt. A work horse killed otherwise (SIGKILL, the worker's cold
shutdown) leaves its requests to run to their end. A job requeued after its requests were
cancelled returns their cancelled Completions: enqueue a new job to run them again.
"""

from __future__ import annotations

import hashlib
import inspect
import os
import re
import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import Any, BinaryIO
from urllib.parse import quote

import msgspec
import redis
from rq import get_current_job
from rq.callbacks import Callback
from rq.job import Job

from producer.client import Producer
from producer.shell import Handle
from producer.completion import Completion
from producer.connect import cluster_from_environment
from producer.errors import InvalidRequest
from producer.protocol import Request
from producer.submission import build_request

BATCH_DIR_ENV = "STREAMBATCH_BATCH_DIR"
LINE_KEYS = frozenset({"prompt", "messages", "prompt_ids", "params", "lane", "request_id", "deadline"})
# rq's own job ids (uuid4) qualify; '_' is kept out so that a batch's `_<n>` cannot collide.
_VERBATIM_JOB_ID = re.compile(r"[A-Za-z0-9-]{1,40}")


class Terminated(Exception):
    """The work horse got SIGTERM while the job ran."""


class BatchRefused(Exception):
    """A batch path outside the rq worker's batch directory, or no batch directory at all."""


def generate(prompt: str | None = None, *, messages: list[dict] | None = None, prompt_ids: list[int] | None = None,
             params: dict | None = None, lane: str | None = None, deadline: float | None = None,
             url: str | None = None, prefix: str = "sb") -> dict[str, Any]:
    """One request (Producer.submit's arguments; its id is the job's) -> its Completion as a dict.
    job.meta["request_id"] names the request, for a backend that follows its tokens live
    (Producer.stream)."""
    job = _current_job()
    request_id = job_request_id(job.id)
    with _producer(job.connection, url, prefix) as producer, _cancelled_if_final(producer, job, [request_id]):
        handle = producer.submit(prompt, messages=messages, prompt_ids=prompt_ids, params=params, lane=lane,
                                 request_id=request_id, deadline=deadline)
        job.meta["request_id"] = request_id
        job.save_meta()
        return msgspec.to_builtins(handle.result())


def batch(input_path: str, output_path: str, *, url: str | None = None, prefix: str = "sb") -> dict[str, int]:
    """Every non-blank line of the JSONL file `input_path` is a request (an object with
    Producer.submit's keys); all are submitted, then their Completions are written to
    `output_path` as JSONL in input order (a line that is no valid request gets an error
    Completion in its place). The files are the worker's, in its batch directory (batch_path).
    Progress in job.meta: {"done": results written, "total": lines}. -> {"total": lines,
    "errors": results that ended in error}."""
    job = _current_job()
    source, target = batch_path(input_path), batch_path(output_path)  # both refused before either is opened
    lines = read_batch(source, job.id)
    job.meta.update(done=0, total=len(lines))
    job.save_meta()
    submitted: list[str] = []
    partial = Path(f"{target}.partial")  # a half-written output never looks finished
    with (_producer(job.connection, url, prefix) as producer, _cancelled_if_final(producer, job, submitted),
          _new_file(partial) as output):
        outcomes: list[Handle | Completion] = []
        for line in lines:
            if isinstance(line, Request):
                submitted.append(line.id)  # before submit: one that fails may still have enqueued
                outcomes.append(producer.submit(line))
            else:
                outcomes.append(line)
        errors = 0
        for done, outcome in enumerate(outcomes, 1):
            completion = outcome.result() if isinstance(outcome, Handle) else outcome
            errors += not completion.ok
            output.write(msgspec.json.encode(completion) + b"\n")
            job.meta["done"] = done
            job.save_meta()
    os.replace(partial, target)  # replaces a link at `target` itself, never what it points to
    return {"total": len(lines), "errors": errors}


def cancel_stopped(job: Job, connection: redis.Redis) -> None:
    """rq's on_stopped callback for these jobs (CANCEL_ON_STOP). rq stops a job by SIGKILLing
    its work horse, so the job cannot cancel its requests itself; the worker runs this after."""
    arguments = inspect.signature(job.func).bind(*job.args, **job.kwargs)
    arguments.apply_defaults()
    if job.func is batch:
        request_ids = [line.id for line in read_batch(batch_path(arguments.arguments["input_path"]), job.id)
                       if isinstance(line, Request)]
    else:
        request_ids = [job_request_id(job.id)]
    with _producer(connection, arguments.arguments["url"], arguments.arguments["prefix"]) as producer:
        for request_id in request_ids:
            producer.cancel(request_id)


CANCEL_ON_STOP = Callback(cancel_stopped)


def batch_path(path: str) -> Path:
    """`path` (relative to the rq worker's batch directory, or absolute) resolved, symlinks
    followed; BatchRefused unless it is inside the batch directory, or when there is none."""
    directory = os.environ.get(BATCH_DIR_ENV)
    if not directory:
        raise BatchRefused(f"batch jobs are off on this rq worker: it has no batch directory "
                           f"(${BATCH_DIR_ENV}, streambatch-rq-worker --batch-dir)")
    root = Path(directory).resolve()
    resolved = (root / path).resolve()
    if not resolved.is_relative_to(root):
        raise BatchRefused(f"batch path {path!r} is outside the batch directory {root}")
    return resolved


def read_batch(path: Path, job_id: str) -> list[Request | Completion]:
    """Each non-blank line of a batch file (a batch_path) as the Request to submit, or as the
    error Completion that takes the place of a line that is no valid request."""
    base = job_request_id(job_id)
    # O_NOFOLLOW: a symlink put in place of the file after batch_path resolved it is not followed.
    with open(path, encoding="utf-8", opener=lambda name, flags: os.open(name, flags | os.O_NOFOLLOW)) as file:
        return [_line_request(text, f"{base}_{number}") for number, text in enumerate(file, 1) if text.strip()]


def job_request_id(job_id: str) -> str:
    """`rq-<job id>`, or `rq-<hash of it>` for a job id that cannot be part of a request id."""
    if _VERBATIM_JOB_ID.fullmatch(job_id):
        return f"rq-{job_id}"
    return "rq-" + hashlib.sha256(job_id.encode()).hexdigest()[:40]


def redis_url(connection: redis.Redis) -> str:
    """The URL of the server `connection` talks to: host or Unix socket, TLS or not, credentials
    and db (not TLS certificate options)."""
    pool = connection.connection_pool
    options = pool.connection_kwargs
    username, password = options.get("username"), options.get("password")
    credentials = ""
    if username or password:
        credentials = quote(username or "", safe="") + (f":{quote(password, safe='')}" if password else "") + "@"
    db = options.get("db", 0)
    if issubclass(pool.connection_class, redis.UnixDomainSocketConnection):
        return f"unix://{credentials}{options['path']}?db={db}"
    scheme = "rediss" if issubclass(pool.connection_class, redis.SSLConnection) else "redis"
    host = options.get("host", "localhost")
    host = f"[{host}]" if ":" in host else host  # IPv6
    return f"{scheme}://{credentials}{host}:{options.get('port', 6379)}/{db}"


def _line_request(text: str, default_id: str) -> Request | Completion:
    try:
        fields = msgspec.json.decode(text, type=dict[str, Any])
        unknown = sorted(fields.keys() - LINE_KEYS)
        if unknown:
            raise InvalidRequest(f"invalid request: unknown keys {unknown}")
        if fields.get("request_id") is None:
            fields["request_id"] = default_id
        return build_request(**fields)
    except (msgspec.DecodeError, InvalidRequest) as error:
        return Completion(default_id, "", [], "error", error=f"invalid_request: {error}")


def _new_file(path: Path) -> BinaryIO:
    """`path` created afresh for writing: whatever is there (an earlier attempt's file, a planted
    symlink or hard link) is unlinked, never written through, and O_EXCL refuses one that
    reappears before the open."""
    with suppress(FileNotFoundError):
        os.unlink(path)
    return os.fdopen(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666), "wb")


def _current_job() -> Job:
    job = get_current_job()
    if job is None:
        raise RuntimeError("producer.rq_jobs functions are rq jobs: enqueue them on an rq queue")
    return job


def _producer(connection: redis.Redis, url: str | None, prefix: str) -> Producer:
    """streambatch at `url`, else on rq's own server; on a cluster ($STREAMBATCH_REDIS_CLUSTER, which
    streambatch-rq-worker --redis-cluster sets) only at `url`: rq's server is one node."""
    if url is None and cluster_from_environment():
        raise ValueError("streambatch is on a Redis Cluster here: give the job url= naming one of its nodes "
                         "(rq's own Redis is a single node)")
    return Producer(url or redis_url(connection), prefix=prefix)


@contextmanager
def _cancelled_if_final(producer: Producer, job: Job, request_ids: list[str]) -> Iterator[None]:
    """Cancel the requests when the job raises and rq will not retry it."""
    with _sigterm_raises():
        try:
            yield
        except BaseException:
            if not job.should_retry:
                for request_id in request_ids:
                    producer.cancel(request_id)
            raise


@contextmanager
def _sigterm_raises() -> Iterator[None]:
    """A fork worker's work horse keeps SIGTERM's default action, dying at once without cleanup;
    while the job runs, SIGTERM raises Terminated instead. A process with a SIGTERM handler of
    its own (a SimpleWorker: warm shutdown) keeps it."""
    in_main_thread = threading.current_thread() is threading.main_thread()
    if not in_main_thread or signal.getsignal(signal.SIGTERM) != signal.SIG_DFL:
        yield
        return

    def terminated(signum, frame):
        raise Terminated("the work horse got SIGTERM")

    signal.signal(signal.SIGTERM, terminated)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
