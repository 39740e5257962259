"""The load on a synthetic fleet: producers that keep the workers full and a live consumer on every
request.

One AsyncProducer per process keeps `target` requests in flight in a closed loop: each slot
submits a request, follows its events live to the end (producer.stream: the replay stream read at
every nudge on its channel), and submits the next. When the target falls, the slots above it
cancel their requests (producer.cancel), so that the load falls within a step or two rather than
a request's length. The streams of a producer share one subscribed connection per node and batch
their replay reads into one pipeline per turn of the event loop (producer/multiplex.py), which is
how one process follows thousands.

The parent drives it over a pipe: ("target", n) sets the requests in flight, "window" answers what
was delivered since the last one (LoadWindow), "stop" ends the process. ("unfollowed", rate), for
what the consumers cost Redis, cancels every request in flight and submits new ones at `rate` per
second with nobody following them, until the next ("target", n).
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import time
from multiprocessing.connection import Connection
from pathlib import Path

from redis.crc import key_slot

from producer import AsyncProducer, DoneEvent, ErrorEvent, ProducerError, TokenEvent

from ops.fleet.child_log import log_to
from ops.fleet.scenario import Scenario
from ops.fleet.windows import LoadWindow

STREAM_TIMEOUT_S = 120.0  # a request not finished by then counts as failed (a wedged fleet, not a slow one)
DROP_WAIT_S = 5.0  # for the slots to cancel their requests, at their next event, before they are stopped


def drive(redis_url: str, cluster: bool, scenario: Scenario, masters_slots: list[list[tuple[int, int]]], seed: int,
          log: Path, control: Connection) -> None:
    log_to(log)
    asyncio.run(Load(redis_url, cluster, scenario, masters_slots, seed, control).run())


class Load:
    def __init__(self, redis_url: str, cluster: bool, scenario: Scenario, masters_slots: list[list[tuple[int, int]]],
                 seed: int, control: Connection) -> None:
        self.redis_url, self.cluster, self.scenario, self.control = redis_url, cluster, scenario, control
        self.masters_slots = masters_slots
        self.producer: AsyncProducer | None = None
        self.rng = random.Random(seed)
        self.target = 0
        self.slots: list[asyncio.Task] = []  # the closed loop's
        self.submitter: asyncio.Task | None = None  # of unfollowed requests
        self.submitting = False  # while it should go on
        self.unfollowed: list[str] = []  # their ids
        self.window = LoadWindow(0.0, 0, 0, 0)
        self.cpu = time.process_time()

    async def run(self) -> None:
        commands: asyncio.Queue = asyncio.Queue()
        loop = asyncio.get_running_loop()
        loop.add_reader(self.control.fileno(), lambda: commands.put_nowait(self.control.recv()))
        async with AsyncProducer(self.redis_url, cluster=self.cluster) as self.producer:
            self.control.send(("ready", None))
            while True:
                match await commands.get():
                    case ("target", count):
                        await self.stop_submitter()
                        self.resize(count)
                    case ("unfollowed", rate):
                        await self.drop_slots()
                        self.submitting = True
                        self.submitter = asyncio.ensure_future(self.submit_unfollowed(rate))
                    case "window":
                        now = time.process_time()
                        self.window.cpu_s = now - self.cpu
                        self.control.send(("window", self.window))
                        self.window, self.cpu = LoadWindow(0.0, 0, 0, 0), now
                    case "stop":
                        await self.stop_submitter()
                        await self.drop_slots()
                        self.control.send(("stopped", None))
                        return

    def resize(self, target: int) -> None:
        """Slots past the target cancel their requests and end; new ones start at once."""
        self.target = target
        self.slots = [slot for slot in self.slots if not slot.done()]
        for index in range(len(self.slots), target):
            self.slots.append(asyncio.ensure_future(self.slot(index)))

    async def slot(self, index: int) -> None:
        while index < self.target:
            prompt, params = self.scenario.request(self.rng)
            try:
                handle = await self.producer.submit(prompt_ids=prompt, params=params, request_id=self.request_id(index))
                async with contextlib.aclosing(self.producer.stream(handle.id, timeout=STREAM_TIMEOUT_S)) as events:
                    async for event in events:
                        if isinstance(event, TokenEvent):
                            self.window.events += 1
                            self.window.tokens += len(event.ids)
                        elif isinstance(event, DoneEvent):
                            self.window.completed += 1
                        elif isinstance(event, ErrorEvent):
                            self.failed(event.code)
                        if index >= self.target:
                            await self.producer.cancel(handle.id)
                            return
            except (ProducerError, TimeoutError) as error:
                self.failed(type(error).__name__)

    def request_id(self, slot: int) -> str | None:
        """On a cluster, an id whose keys are on the slot's master (slot number mod the masters), so that
        every master holds an equal share of the requests in flight, as the tens of thousands of a
        real fleet's spread by their ids' hashes; a few hundred requests spread that way would load
        the busiest master a tenth or more above the mean, and a master is busiest at a time. On one
        node, the producer's own id."""
        if not self.masters_slots:
            return None
        ranges = self.masters_slots[slot % len(self.masters_slots)]
        while True:
            request_id = f"{self.rng.getrandbits(64):016x}"
            if any(start <= key_slot(request_id.encode()) <= end for start, end in ranges):
                return request_id

    async def drop_slots(self) -> None:
        """Every slot cancels its request and ends; one that hears no event meanwhile (its worker
        gone) is stopped. None starts another request, even one whose stop reached it as its
        stream's timeout (asyncio.timeout can take a cancel for its own on Python 3.11)."""
        self.target = 0
        if self.slots:
            _, waiting = await asyncio.wait(self.slots, timeout=DROP_WAIT_S)
            for slot in waiting:
                slot.cancel()
            await asyncio.gather(*waiting, return_exceptions=True)
        self.slots = []

    async def submit_unfollowed(self, rate: float) -> None:
        loop = asyncio.get_running_loop()
        due = loop.time()
        while self.submitting:
            prompt, params = self.scenario.request(self.rng)
            try:
                self.unfollowed.append((await self.producer.submit(prompt_ids=prompt, params=params)).id)
            except ProducerError as error:
                self.failed(type(error).__name__)
            due += 1 / rate
            await asyncio.sleep(max(0.0, due - loop.time()))

    async def stop_submitter(self) -> None:
        """No more unfollowed requests, and those submitted are cancelled (the finished ones too,
        which changes nothing): the closed loop that follows finds the workers holding its own.
        The submitter also stops at its next turn by itself, should the cancel be lost in a submit;
        one still running after DROP_WAIT_S is left behind, its stack in the log."""
        if self.submitter is not None:
            self.submitting = False
            self.submitter.cancel()
            _, running = await asyncio.wait({self.submitter}, timeout=DROP_WAIT_S)
            for task in running:
                print(f"the unfollowed requests' submitter did not stop within {DROP_WAIT_S:.0f} s:", flush=True)
                task.print_stack()
            self.submitter = None
        for request_id in self.unfollowed:
            with contextlib.suppress(ProducerError):
                await self.producer.cancel(request_id)
        self.unfollowed = []

    def failed(self, reason: str) -> None:
        self.window.failures[reason] = self.window.failures.get(reason, 0) + 1
