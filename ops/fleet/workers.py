"""A process of synthetic workers: each one the real worker loop (worker.service.Worker: intake,
claims, fenced writes, heartbeats, reclaims, acks) around a SyntheticEngine, in a thread of its own.

Workers share a process because each mostly sleeps through its steps. What they do in Python (the
scheduler, encoding events, redis-py's packing and parsing) needs the GIL, so a process holds only
a few (ops/fleet's --workers-per-process), and threads hand the GIL on after 1 ms instead of
Python's 5: a worker waking from its step waits less for its neighbours, as a worker of its own
process would not wait at all. The step rate each window reports shows whether they kept pace.

The parent drives it over a pipe: "window" answers what happened since the last one (HostWindow),
"stop" drains the workers (each hands back what it holds at once) and ends the process.
"""

from __future__ import annotations

import sys
import threading
import time
from multiprocessing.connection import Connection
from pathlib import Path

from producer.connect import connect
from producer.protocol import Keys
from worker.intake import Admission
from worker.logs import configure_logging
from worker.service import Worker

from ops.fleet.child_log import log_to
from ops.fleet.engine import AdmitTiming, SyntheticEngine
from ops.fleet.scenario import Scenario
from ops.fleet.windows import HostWindow

GIL_SWITCH_S = 0.001


class FleetWorker(Worker):
    """The worker, noting when each request it starts was claimed and when it entered the engine."""

    engine: SyntheticEngine

    def start(self, admission: Admission) -> None:
        claimed = time.time() - (time.monotonic() - admission.claimed)
        super().start(admission)
        self.engine.tally.admissions.append(AdmitTiming(admission.name, claimed, time.time()))


def serve(redis_url: str, cluster: bool, names: list[str], scenario: Scenario, log: Path,
          control: Connection) -> None:
    """The process's body: start the workers, answer "ready" (or the error that stopped them), then
    the parent's commands."""
    log_to(log)
    configure_logging("warning")
    sys.setswitchinterval(GIL_SWITCH_S)
    try:
        workers = [FleetWorker(scenario.worker_config(redis_url, cluster, name),
                          engine=SyntheticEngine(scenario.engine_config(), scenario.cost)) for name in names]
        reader = connect(redis_url, cluster=cluster)
    except Exception as error:  # whatever it is, the parent says it in one line
        control.send(("error", f"{type(error).__name__}: {error}"))
        return
    threads = [threading.Thread(target=worker.run, name=worker.config.name, daemon=True) for worker in workers]
    for thread in threads:
        thread.start()
    control.send(("ready", None))
    cpu = time.process_time()
    while True:
        command = control.recv()
        if command == "window":
            now = time.process_time()
            control.send(("window", window(workers, reader, now - cpu)))
            cpu = now
        elif command == "stop":
            for worker in workers:
                worker.stop()
            for thread in threads:
                thread.join()
            control.send(("stopped", None))
            return


def window(workers: list[Worker], reader, cpu_s: float) -> HostWindow:
    tallies = [worker.engine.take_tally() for worker in workers]
    found = HostWindow(len(workers), cpu_s, sum(tally.steps for tally in tallies),
                       sum(tally.tokens for tally in tallies), sum(tally.scheduled for tally in tallies))
    admissions = [admission for tally in tallies for admission in tally.admissions]
    for admission, enqueued in zip(admissions, enqueued_at(reader, admissions)):
        if enqueued is not None:
            found.intake_s.append(admission.claimed - enqueued)
            found.started_s.append(admission.started - enqueued)
    return found


def enqueued_at(reader, admissions: list[AdmitTiming]) -> list[float | None]:
    """When each request's entry was XADDed (unix seconds, to the millisecond, rounded down: the
    entry id's time part), read from its attempt key, "<attempt> <stream> <entry id>" (claims.py),
    which outlives the request by the replay TTL. None for one whose key is gone or elsewhere."""
    pipe = reader.pipeline(transaction=False)
    for admission in admissions:
        tenant, _, request_id = admission.request_id.partition("/")
        pipe.get(Keys(tenant=tenant).attempt(request_id))
    found = []
    for value in pipe.execute(raise_on_error=False) if admissions else []:
        entry_id = value.split()[-1] if isinstance(value, bytes) else b""
        found.append(int(entry_id.split(b"-")[0]) / 1000 if b"-" in entry_id else None)
    return found
