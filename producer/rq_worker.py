"""streambatch-rq-worker: an rq worker that runs streambatch's rq jobs and nothing else.

    streambatch-rq-worker llm --url redis://redis:6379/0 --batch-dir /data/batches

A plain `rq worker` imports and calls whatever function a job names, so anyone who can push onto
its queue runs code on it (`subprocess.getoutput`, `os.system`). This one looks every function a
job names (the job's own, and its success, failure and stopped callbacks) up in a fixed table of
producer.rq_jobs' functions: any other name fails the job with UnknownJobFunction, and nothing of
that name is imported or called. It always uses the JSON serializer: a pickled job runs code as
it is loaded. Batch jobs read and write only in the batch directory (rq_jobs.batch_path).

This guards the worker, not the queue: rq queues must still be per team (rq_jobs' docstring).
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable
from typing import Any

import redis
from rq import Worker
from rq.job import Job
from rq.serializers import JSONSerializer

from producer import rq_jobs
from producer.connect import CLUSTER_ENV, cluster_from_environment
from producer.protocol import read_password, redacted

JOB_FUNCTIONS = {f"{function.__module__}.{function.__qualname__}": function
                 for function in (rq_jobs.generate, rq_jobs.batch)}
CALLBACKS = {rq_jobs.CANCEL_ON_STOP.name: rq_jobs.cancel_stopped}
PUBSUB_WAKE_S = 1.0


class UnknownJobFunction(Exception):
    """A job names a function that is not one of streambatch's rq jobs or callbacks."""


def _ours(name: str | None, table: dict[str, Callable[..., Any]]) -> Callable[..., Any] | None:
    if name is None:
        return None
    if name not in table:
        raise UnknownJobFunction(f"this worker runs only streambatch's rq jobs: {name!r} is not one of "
                                 f"{', '.join(table)}")
    return table[name]


class StreambatchJob(Job):
    """rq's Job, whose functions come from the tables above, where rq would import them by name."""

    @property
    def func(self):
        return _ours(self.func_name, JOB_FUNCTIONS)

    @property
    def success_callback(self):
        return _ours(self._success_callback_name, CALLBACKS)

    @property
    def failure_callback(self):
        return _ours(self._failure_callback_name, CALLBACKS)

    @property
    def stopped_callback(self):
        return _ours(self._stopped_callback_name, CALLBACKS)


class PromptStop:
    """For an rq worker class: its commands' thread (rq's subscribe) wakes every PUBSUB_WAKE_S
    rather than every 60 s. From redis-py 8.2 on, rq's unsubscribe waits for that thread to see
    that it should stop, so a worker that was done (a --burst one) took up to a minute to end."""

    def subscribe(self) -> None:
        self.log.info("Worker %s: subscribing to channel %s", self.name, self.pubsub_channel_name)
        self.pubsub = self.connection.pubsub()
        self.pubsub.subscribe(**{self.pubsub_channel_name: self.handle_payload})
        self.pubsub_thread = self.pubsub.run_in_thread(sleep_time=PUBSUB_WAKE_S, daemon=True,
                                                       exception_handler=self._pubsub_exception_handler)


class StreambatchWorker(PromptStop, Worker):
    """rq's forking Worker with StreambatchJob and the JSON serializer, whatever it is given."""

    def __init__(self, queues, **options) -> None:
        super().__init__(queues, **options | {"job_class": StreambatchJob, "serializer": JSONSerializer})


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="streambatch-rq-worker", description=__doc__.split("\n")[0])
    parser.add_argument("queues", nargs="+", help="the team's own rq queues")
    # The environment's values are read after parsing, never made defaults: --help would print them.
    parser.add_argument("--url", help="the team's rq Redis (default: $STREAMBATCH_REDIS_URL); a password is "
                                      "better kept in the file $STREAMBATCH_REDIS_PASSWORD_FILE")
    parser.add_argument("--batch-dir", help=f"the directory batch jobs' files must be in (default: "
                                            f"${rq_jobs.BATCH_DIR_ENV}; without one, batch jobs are refused)")
    parser.add_argument("--burst", action="store_true", help="exit once the queues are empty")
    parser.add_argument("--redis-cluster", action="store_true", default=cluster_from_environment(),
                        help="streambatch's Redis is a Redis Cluster, which the jobs name with url= (rq's own "
                             f"Redis is one node; default: ${CLUSTER_ENV})")
    args = parser.parse_args(argv)
    url = args.url or os.environ.get("STREAMBATCH_REDIS_URL")
    if not url:
        parser.error("no Redis URL: give --url or set $STREAMBATCH_REDIS_URL")
    password_file = os.environ.get("STREAMBATCH_REDIS_PASSWORD_FILE")
    try:
        password = read_password(password_file) if password_file else None
    except (OSError, ValueError) as error:
        parser.error(f"$STREAMBATCH_REDIS_PASSWORD_FILE: {error}")
    batch_dir = args.batch_dir or os.environ.get(rq_jobs.BATCH_DIR_ENV)
    if batch_dir:
        if not os.path.isdir(batch_dir):
            parser.error(f"--batch-dir {batch_dir}: no such directory")
        os.environ[rq_jobs.BATCH_DIR_ENV] = batch_dir  # where rq_jobs.batch_path looks, in the work horses too
    if args.redis_cluster:
        os.environ[CLUSTER_ENV] = "1"  # the jobs' producers, in the work horses
    try:
        connection = redis.Redis.from_url(url, password=password)
    except ValueError as error:  # redis-py's word on a URL it cannot parse
        parser.error(f"bad --url {redacted(url)!r}: {error}")
    print(f"streambatch-rq-worker: queues {', '.join(args.queues)} on {redacted(url)}, batch directory "
          f"{batch_dir or 'none (batch jobs refused)'}", flush=True)
    StreambatchWorker(args.queues, connection=connection).work(burst=args.burst)
