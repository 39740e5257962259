"""The worker loop: intake -> engine.step() -> outbox, with housekeeping every heartbeat.

One `poll()` is one turn:
  1. housekeeping when due: read the tenant registry (serving new tenants' streams), refresh
     our entries (dropping those another worker took), sweep the cancel keys, take back our own
     entries that we dropped, reclaim idle entries of dead workers, apply the pinned prefixes,
     beat; now and then delete dead consumers and trim old dead letters;
  2. cancellations nudged on the tenants' cancel channels (each checked against its key);
  3. when idle, intake as much as the backpressure rule allows (a blocking read);
  4. deadlines of requests not started yet, then one engine step, during which the intake reads
     and claims what the backpressure rule allows, started as the step ends (step_intake.py);
  5. the outbox writes the turn's events in one round trip; finished entries are acked.

A Redis error (or any other failure of a turn) drops every request held: their entries stay
pending under this worker, which takes them back (without raising their delivery counts) and
resumes each from its replay stream at the first housekeeping that reaches Redis again, so
nothing is written twice or lost, and a blip costs a recompute. Turns that keep failing are
spaced out, up to MAX_TURN_RETRY_S apart. One error is no such failure: NOGROUP, a lane stream
(or its group) deleted under the worker, which makes the group again and goes on with what it
holds. A failed engine step is the engine's to recover from (engine.py); a long one is kept
alive by step_watch.py, and a hung one ends the process.
"""

from __future__ import annotations

import itertools
import os
import sys
import time
from collections.abc import Callable
from typing import TypeVar

import msgspec
import redis
import structlog
from redis.exceptions import RedisClusterException

from producer.connect import connect
from producer.protocol import (DEFAULT_TENANT, LANES, Keys, Request, decode_request, encode, is_missing_group,
                               is_tls_refusal, read_password)
from worker.cancels import Cancels
from worker.claims import Claims
from worker.config import WorkerConfig
from worker.engine.engine import Engine
from worker.engine.fairness import TenantShare
from worker.engine.inputs import PromptError, PromptTooLong
from worker.engine.sequence import FinishReason
from worker.entries import Entry, Rejected, engine_prompt
from worker.flight import Flight
from worker.heartbeat import Heartbeat, StartupBeat, new_consumer
from worker.intake import Admission, Intake, intake_room, waiting_tenants
from worker.metrics import Health, Metrics
from worker.outbox import Outbox
from worker.step_intake import StepIntake
from worker.step_watch import StepWatch
from worker.tenants import LaneStreams, read_registry

T = TypeVar("T")
TURN_RETRY_S, MAX_TURN_RETRY_S = 0.1, 5.0  # the wait after a failed turn, doubling while turns keep failing
SWEEP_BEATS = 30  # housekeeping rounds between sweeps of dead consumers and old dead letters
EXIT_STALLED = 70  # the process's status when it ends itself for a stuck loop (EX_SOFTWARE)


def retry_wait_s(failures: int) -> float:
    """The wait after the `failures`-th failure in a row (of a turn, or of reaching Redis at start)."""
    return min(MAX_TURN_RETRY_S, TURN_RETRY_S * 2 ** (failures - 1))


class Worker:
    def __init__(self, config: WorkerConfig, engine: Engine | None = None) -> None:
        """Loads the engine unless one is given, beating "starting" with each phase meanwhile; the
        metrics port is served from before the load, so that /readyz says "starting" all along."""
        self.config = config
        self.keys = Keys(config.prefix)
        self.consumer = new_consumer(config.name)
        password = read_password(config.redis_password_file) if config.redis_password_file else None
        self.log = structlog.get_logger("worker").bind(worker=config.name, consumer=self.consumer)
        # A cluster client reads the slot map as it is made: a cluster not up (or formed) yet is waited for.
        self.client = self.wait_for_redis(lambda: connect(config.redis_url, cluster=config.redis_cluster,
                                                          password=password))
        self.health = Health(stall_timeout=config.stall_timeout)
        self.metrics = Metrics(self.health)
        self.metrics_server = (self.metrics.serve(config.metrics_host, config.metrics_port)
                               if config.metrics_port is not None else None)
        self.streams = LaneStreams(self.keys)
        self.heartbeat = Heartbeat(self.client, self.keys, self.streams, config, self.metrics, self.consumer)
        if engine is None:
            with StartupBeat(self.heartbeat, self.log) as on_phase:
                engine = Engine(config.engine, on_phase=on_phase)
        self.engine = engine
        if config.replay_maxlen <= self.engine.max_model_len:
            raise ValueError(f"replay_maxlen ({config.replay_maxlen}) must exceed the model length "
                             f"({self.engine.max_model_len}): every event of a request must stay replayable")
        self.wait_for_redis(self.client.ping)
        self.refuse_v1_layout()
        blocking = self.client if config.redis_cluster else connect(config.redis_url, password=password,
                                                                    blocking_ms=config.block_ms,
                                                                    single_connection=True)
        self.claims = Claims(self.client, self.keys, self.streams, self.consumer, config.replay_ttl,
                             config.reclaim_idle_ms)
        self.intake = Intake(self.client, blocking, self.keys, self.streams, self.consumer, config.replay_ttl,
                             self.claims, self.metrics, self.log)
        self.step_intake = StepIntake(self.intake, self.client, config.block_ms)
        self.outbox = Outbox(self.client, config.replay_maxlen, config.replay_ttl)
        self.cancels = Cancels(self.client)
        self.step_watch = StepWatch(config.heartbeat_interval, self.keep_alive, self.health.stall, self.exit_stalled,
                                    self.log)
        self.registry_problems: list[str] = []  # what was wrong with the registry last time (said when it changes)
        self.serve_registered()
        # Pinned prefixes, by name: this worker's own (--pin-prefix) and those published in Redis.
        self.own_pins = {f"--pin-prefix:{i + 1}": encode(Request(prompt=text))
                         for i, text in enumerate(config.pin_prefix)}
        self.pins_seen: dict[str, bytes] = {}  # name -> the value applied (or refused) last
        self.pins_unreadable = False  # Keys.pins is not a hash (said once)
        self.flights: dict[str, Flight] = {}  # by Flight.name
        self.next_housekeeping = 0.0
        self.housekeeping_rounds = 0
        self.inherited = False  # the entries of this worker's earlier lives, taken at the first housekeeping
        self.failed_turns = 0  # in a row
        self.generated = 0  # tokens, for the heartbeat's rate
        self.stopping = False  # set by a signal handler: nothing else happens there
        self.drain_until: float | None = None
        self.done = False
        self.health.state = "ready"  # the engine is loaded and Redis answered (ensure_groups)

    def wait_for_redis(self, reach: Callable[[], T]) -> T:
        """-> `reach()` once Redis answers it. A Redis that is not up yet, or restarting, is waited
        for (saying so once), not a reason to exit: a worker started with or before its Redis comes
        up when it does. A refused password or TLS handshake is no such wait: it raises."""
        for failures in itertools.count(1):
            try:
                return reach()
            except redis.AuthenticationError:
                raise
            except (redis.ConnectionError, redis.TimeoutError, RedisClusterException) as error:
                if is_tls_refusal(error):
                    raise
                if failures == 1:
                    self.log.warning("worker.waiting_for_redis", error=str(error))
                time.sleep(retry_wait_s(failures))

    def refuse_v1_layout(self) -> None:
        """Layout v1's lane streams (before tenants) must be empty: this worker would never read
        them. Raises ValueError, with how to drain them, if they hold entries."""
        pipe = self.client.pipeline(transaction=False)
        for lane in LANES:
            pipe.xlen(self.keys.v1_requests(lane))
        waiting = {self.keys.v1_requests(lane): length for lane, length in zip(LANES, pipe.execute()) if length}
        if waiting:
            raise ValueError(f"this Redis holds {sum(waiting.values())} requests in the streams of the layout before "
                             f"tenants ({', '.join(waiting)}): drain them with the previous release's workers "
                             "(or delete those streams) before starting this one")

    def serve_registered(self) -> None:
        """Serve every tenant in the registry (and the default one); a new one's streams get the
        group and its cancel channel a subscription. Bad registry entries are logged, not served."""
        try:
            registered, problems = read_registry(self.client, self.keys)
        except redis.ResponseError as error:  # WRONGTYPE: someone wrote over the key
            registered, problems = {}, [str(error)]
        if problems != self.registry_problems:
            if problems:
                self.log.warning("tenants.unreadable", key=self.keys.tenants, problems=problems)
            self.registry_problems = problems
        new = self.streams.serve({DEFAULT_TENANT: 1} | {name: entry.max_shards for name, entry in registered.items()})
        self.engine.set_tenants({name: TenantShare(entry.weight, entry.max_running)
                                 for name, entry in registered.items()})
        fair = self.config.engine.scheduler.fairness == "vtc"
        self.intake.set_weights({name: entry.weight for name, entry in registered.items()} if fair else {})
        if new:
            self.intake.ensure_groups(new)
            self.log.info("tenants.serving", tenants=self.streams.tenants)
        self.cancels.follow([stream.keys for stream in self.streams.by_name.values()])

    # --- the loop ----------------------------------------------------------------------
    def run(self) -> None:
        self.log.info("worker.ready", model=self.config.engine.model, num_blocks=self.engine.pool.num_blocks)
        self.health.last_turn = time.monotonic()  # the stall clock starts with the loop
        try:
            while not self.done:
                self.turn()
        finally:
            self.close()

    def turn(self) -> None:
        """One poll. A failure costs the requests held (their entries stay pending for a reclaim),
        never the worker; the engine recovers from a failed step by itself (engine.py)."""
        failed = True
        try:
            self.poll()
            failed = False
        except redis.RedisError as error:
            if is_missing_group(error):
                failed = not self.recreate_groups(error)
            else:
                self.log.error("worker.redis_error", error=str(error), failed_turns=self.failed_turns + 1)
                self.health.redis_error = str(error)
                self.drop_all("redis error")
        except Exception:
            self.log.exception("worker.turn_failed", failed_turns=self.failed_turns + 1)
            self.drop_all("worker error")
        now = self.health.last_turn = time.monotonic()
        if not failed:
            self.failed_turns = 0
            self.health.redis_error = self.health.failing_since = None
        elif self.drain_until is not None and now >= self.drain_until:
            # SIGTERM while turns fail (Redis gone): nothing can be handed back, and what this worker
            # held stays pending for a reclaim; the drain ends on time all the same
            self.log.warning("worker.drain_ended_unreachable", failed_turns=self.failed_turns + 1)
            self.done = True
        else:
            self.failed_turns += 1
            self.health.failing_since = self.health.failing_since or now
            wait = retry_wait_s(self.failed_turns)
            time.sleep(wait if self.drain_until is None else min(wait, self.drain_until - now))

    def recreate_groups(self, error: redis.RedisError) -> bool:
        """A lane stream or its group was deleted under us: make it again and go on with what we hold
        (entries the group forgot are either gone with their stream or delivered again, and a
        request found finished on its claim is only acked). -> whether Redis took it."""
        self.log.warning("worker.lane_group_missing", error=str(error))
        try:
            self.intake.ensure_groups()
        except redis.RedisError as failure:
            self.log.error("worker.redis_error", error=str(failure), failed_turns=self.failed_turns + 1)
            self.health.redis_error = str(failure)
            self.drop_all("redis error")
            return False
        return True

    def drop_all(self, reason: str) -> None:
        """After a failed turn: every request goes, taken back by the next housekeeping (the turn
        then waits a while, the longer the more turns failed in a row)."""
        for flight in list(self.flights.values()):
            self.drop(flight, reason)
        self.next_housekeeping = 0.0  # take them back as soon as Redis answers

    def stop(self) -> None:
        """Drain (SIGTERM): safe to call from a signal handler."""
        self.stopping = True

    def poll(self) -> None:
        if self.stopping and self.drain_until is None:
            self.drain_until = time.monotonic() + self.config.drain_timeout
            self.health.state = "draining"
            self.log.info("worker.draining", in_flight=len(self.flights), timeout_s=self.config.drain_timeout)
        if time.monotonic() >= self.next_housekeeping:
            self.housekeeping()
        nudged = [self.flights[name] for name in self.cancels.nudged() if name in self.flights]
        self.cancel(self.cancels.swept(nudged))
        if self.drain_until is not None or not self.engine.has_unfinished:  # no step will read them
            for admission in self.step_intake.stand_down(self.held(), self.engine.requests):
                self.start(admission)
        if self.drain_until is None and not self.engine.has_unfinished:
            for admission in self.intake.take(intake_room(self.engine, self.config.intake_ahead),
                                              self.config.block_ms, self.held(), self.engine.requests,
                                              waiting_tenants(self.engine)):
                self.start(admission)
        self.expire_deadlines()
        if self.engine.has_unfinished:
            self.step()
        self.publish()
        if self.drain_until is not None and (not self.flights or time.monotonic() >= self.drain_until):
            self.hand_back()
            self.done = True

    def housekeeping(self) -> None:
        self.next_housekeeping = time.monotonic() + self.config.heartbeat_interval
        self.serve_registered()
        for flight in self.claims.refresh(list(self.flights.values())):
            self.drop(flight, "claimed by another worker")
        self.cancel(self.cancels.swept([flight for flight in self.flights.values() if flight.sequence]))
        if self.drain_until is None:
            if not self.inherited:
                inherited = self.claims.inherit()
                self.inherited = True
                if inherited:
                    self.metrics.reclaimed.inc(len(inherited))
                    self.log.info("worker.inherited", entries=[entry.entry_id for entry in inherited])
                    self.take(inherited)
            held = {(flight.entry.stream, flight.entry.entry_id) for flight in self.flights.values()}
            taken_back = self.claims.take_back(held, intake_room(self.engine, self.config.intake_ahead))
            if taken_back:
                self.log.info("worker.took_back", entries=[entry.entry_id for entry in taken_back])
                self.take(taken_back)
            reclaimed = self.claims.reclaim(intake_room(self.engine, self.config.intake_ahead))
            if reclaimed:
                self.metrics.reclaimed.inc(len(reclaimed))
                self.log.info("worker.reclaimed", entries=[entry.entry_id for entry in reclaimed])
                self.take(reclaimed)
        self.apply_pins()
        self.heartbeat.beat(self.engine, len(self.flights), self.generated, draining=self.drain_until is not None)
        if self.housekeeping_rounds % SWEEP_BEATS == 0:
            deleted = self.claims.sweep(self.config.dead_letter_ttl)
            if deleted:
                self.log.info("worker.deleted_dead_consumers", consumers=deleted)
        self.housekeeping_rounds += 1

    def apply_pins(self) -> None:
        """Make the engine's pins this worker's own plus those published (`Keys.pins`): a pin that
        went or changed is unpinned, a new one pinned. One that cannot be is logged once, and tried
        again when another pin makes room or its value changes."""
        published = self.published_pins()
        wanted = published | self.own_pins
        gone = [name for name, value in self.pins_seen.items() if wanted.get(name) != value]
        for name in gone:
            if self.engine.unpin(name):
                self.log.info("pin.removed", pin=name)
            del self.pins_seen[name]
        if gone:
            self.pins_seen = {name: value for name, value in self.pins_seen.items() if name in self.engine.pins}
        for name, value in wanted.items():
            if name in self.pins_seen:
                continue
            self.pins_seen[name] = value
            try:
                blocks = self.engine.pin(name, **engine_prompt(decode_request(value)))
            except (msgspec.DecodeError, ValueError) as error:  # PromptError included
                self.log.warning("pin.refused", pin=name, reason=str(error))
            else:
                self.log.info("pin.applied", pin=name, blocks=blocks)
        self.metrics.pinned_blocks.set(self.engine.pool.num_pinned_blocks)

    def published_pins(self) -> dict[str, bytes]:
        """`Keys.pins`, or nothing while it is not a hash (told once); names that are not UTF-8 are
        kept as best decoded, so that the value's own check refuses or applies them."""
        try:
            published = self.client.hgetall(self.keys.pins)
        except redis.ResponseError as error:  # WRONGTYPE: someone wrote over the key
            if not self.pins_unreadable:
                self.log.warning("pins.unreadable", key=self.keys.pins, reason=str(error))
            self.pins_unreadable = True
            return {}
        self.pins_unreadable = False
        return {name.decode(errors="replace"): value for name, value in published.items()}

    def keep_alive(self, flights: list[Flight]) -> None:
        """During a long step (StepWatch's thread): refresh the step's claims, extend the heartbeat."""
        self.claims.refresh(flights)  # any lost ones are found again, and dropped, by the next housekeeping
        self.heartbeat.extend()

    def exit_stalled(self, reason: str) -> None:
        """The loop is stuck (StepWatch's thread, while the main thread is in the hung call): end
        the process, so that its requests are reclaimed and its restart policy starts it again."""
        self.log.critical("worker.stalled", reason=reason, in_flight=len(self.flights), exit_status=EXIT_STALLED)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(EXIT_STALLED)

    # --- intake ------------------------------------------------------------------------
    def take(self, entries: list[Entry]) -> None:
        """Start what reclaimed entries carry (`Intake.admit` settles the rest)."""
        for admission in self.intake.admit(entries, self.held(), self.engine.requests):
            self.start(admission)

    def held(self) -> dict[str, Entry]:
        """The entry of each request this worker holds, by engine id."""
        return {name: flight.entry for name, flight in self.flights.items()}

    def start(self, admission: Admission) -> None:
        request_id, entry, request, claim = admission.request_id, admission.entry, admission.request, admission.claim
        stream = self.streams[entry.stream]
        emitted = claim.emitted_token_ids
        flight = Flight(request_id, stream.keys, entry, claim.attempt, next_seq=len(claim.events),
                        resumed=bool(emitted), log=self.log.bind(tenant=stream.tenant, request_id=request_id),
                        received=admission.claimed)
        self.flights[flight.name] = flight
        if isinstance(request, Rejected):
            self.refuse(flight, "invalid_request", request.reason)
        elif entry.deliveries > self.config.max_deliveries:
            self.refuse(flight, "dead_letter", f"gave up after {entry.deliveries} deliveries")
        else:
            try:
                flight.sequence = self.engine.add_request(
                    flight.name, **engine_prompt(request), params=request.params, lane=stream.lane,
                    emitted_token_ids=emitted, tenant=stream.tenant)
            except PromptError as error:
                self.refuse(flight, "too_long" if isinstance(error, PromptTooLong) else "invalid_request", str(error))
                return
            except Exception as error:  # a request the engine cannot take must not fail everyone's turn
                flight.log.exception("request.unservable")
                self.refuse(flight, "internal", f"the worker could not start this request: {error!r}")
                return
            flight.log.info("request.started", attempt=claim.attempt, lane=flight.sequence.lane,
                            resumed_tokens=len(emitted))
            if claim.cancelled:
                self.engine.abort(flight.name, FinishReason.CANCELLED)
            elif request.deadline is not None and not flight.started:
                flight.deadline = request.deadline

    def refuse(self, flight: Flight, code: str, message: str) -> None:
        """An error event for a request the engine will not serve; dead-lettered at its ack."""
        flight.log.warning("request.refused", code=code, reason=message)
        self.outbox.add_error(flight, code, message)
        flight.dead_letter = message

    # --- cancellation (see cancels.py) and deadlines --------------------------------------
    def cancel(self, flights: list[Flight]) -> None:
        for flight in flights:
            if self.engine.abort(flight.name, FinishReason.CANCELLED):
                flight.log.info("request.cancelling")

    def expire_deadlines(self) -> None:
        now = time.time()
        for flight in self.flights.values():
            if flight.deadline is not None and (flight.started or now >= flight.deadline):
                if not flight.started:
                    self.engine.abort(flight.name, FinishReason.DEADLINE)
                flight.deadline = None  # started in time, or expired: no longer watched

    # --- step and outbox ---------------------------------------------------------------
    def step(self) -> None:
        """One engine step, the intake overlapped with it unless draining; what the intake took
        starts as the step ends."""
        taking = None
        if self.drain_until is None:
            taking = self.step_intake.start(intake_room(self.engine, self.config.intake_ahead), self.held(),
                                            self.engine.requests, waiting_tenants(self.engine))
        started = time.monotonic()
        try:
            with self.step_watch.step(list(self.flights.values())):
                outputs = self.engine.step()
        finally:
            admitted = taking.finish() if taking is not None else []
        now = time.monotonic()
        self.metrics.step_time.observe(now - started)
        self.metrics.observe_engine(self.engine)
        for output in outputs:
            flight = self.flights.get(output.request_id)
            if flight is None:
                continue  # dropped: another worker holds it now
            self.metrics.observe_output(flight, output, now)
            if output.token_ids:
                flight.last_token = now
                self.generated += len(output.token_ids)
            if output.poisoned:  # every engine step with it failed: it goes to the dead letters
                self.refuse(flight, "internal", output.error)
                continue
            if output.finished:
                flight.log.info("request.finished", reason=output.finish_reason, error=output.error,
                                completion_tokens=output.usage.completion_tokens)
            self.outbox.add_output(flight, output)
        for admission in admitted:
            self.start(admission)

    def publish(self) -> None:
        done, dead, fences = [], [], []
        for flight, written in self.outbox.flush(list(self.flights.values())):
            if not written:
                self.drop(flight, "claimed by another worker")
            elif flight.finished:
                del self.flights[flight.name]
                fences.append(flight.keys.attempt(flight.request_id))
                if flight.dead_letter:
                    dead.append((flight.entry, flight.dead_letter, flight.request_id))
                else:
                    done.append(flight.entry)
        if fences:
            self.intake.ack(done, dead, fences)
            self.metrics.dead_letters.inc(len(dead))

    def drop(self, flight: Flight, reason: str) -> None:
        """Forget a request without acking it: its entry stays pending for a reclaim."""
        del self.flights[flight.name]
        if flight.sequence is not None:
            self.engine.abort(flight.name)
        flight.log.warning("request.dropped", reason=reason)

    # --- shutdown ----------------------------------------------------------------------
    def hand_back(self) -> None:
        flights = list(self.flights.values())
        self.claims.hand_back([flight.entry for flight in flights])
        for flight in flights:
            self.drop(flight, "handed back")

    def close(self) -> None:
        """Leave the group and stop the heartbeat (what Redis lets us do of it), then let go of
        the threads, the engine's other tensor-parallel ranks, the metrics port and every Redis
        connection."""
        try:
            self.heartbeat.clear()
            self.claims.retire()
        except redis.RedisError as error:
            self.log.error("worker.close_failed", error=str(error))
        self.step_watch.close()
        self.cancels.close()
        if self.intake.nudges is not None:
            self.intake.nudges.stop()
        self.step_intake.close()
        self.intake.blocking.close()
        self.client.close()
        self.engine.close()
        if self.metrics_server is not None:
            self.metrics_server.shutdown()
            self.metrics_server.server_close()
        self.log.info("worker.stopped")

