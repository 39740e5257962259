"""The load on a synthetic fleet: producers that keep the workers full and a live consumer on every
request.

One AsyncProducer per process keeps `target` requests in flight in a closed loop: each slot
submits a request, follows its events live to the end (producer.stream: the replay stream read at
every nudge on its channel), and submits the next. The streams of a producer share one subscribed
connection per node and batch their replay reads into one pipeline per turn of the event loop
(producer/multiplex.py), which is how one process follows thousands.

The parent drives it over a pipe: ("target", n) sets the requests in flight, "window" answers what
was delivered since the last one (LoadWindow), "stop" ends the process. ("unfollowed", rate)
measures what the consumers cost Redis: every stream is dropped, and requests are submitted at
`rate` per second with nobody following them.
"""

from __future__ import annotations

import asyncio
import random
import sys
import time
from multiprocessing.connection import Connection
from pathlib import Path

from producer import AsyncProducer, DoneEvent, ErrorEvent, ProducerError, TokenEvent

from ops.fleet.scenario import Scenario
from ops.fleet.windows import LoadWindow

STREAM_TIMEOUT_S = 120.0  # a request not finished by then counts as failed (a wedged fleet, not a slow one)


def drive(redis_url: str, cluster: bool, scenario: Scenario, seed: int, log: Path, control: Connection) -> None:
    sys.stdout = sys.stderr = log.open("w", buffering=1)
    asyncio.run(Load(redis_url, cluster, scenario, seed, control).run())


class Load:
    def __init__(self, redis_url: str, cluster: bool, scenario: Scenario, seed: int, control: Connection) -> None:
        self.redis_url, self.cluster, self.scenario, self.control = redis_url, cluster, scenario, control
        self.rng = random.Random(seed)
        self.target = 0
        self.slots: list[asyncio.Task] = []  # the closed loop's, or the one that submits unfollowed requests
        self.window = LoadWindow(0.0, 0, 0, 0)
        self.cpu = time.process_time()

    async def run(self) -> None:
        commands: asyncio.Queue = asyncio.Queue()
        loop = asyncio.get_running_loop()
        loop.add_reader(self.control.fileno(), lambda: commands.put_nowait(self.control.recv()))
        async with AsyncProducer(self.redis_url, cluster=self.cluster) as producer:
            self.control.send(("ready", None))
            while True:
                match await commands.get():
                    case ("target", count):
                        self.resize(producer, count)
                    case ("unfollowed", rate):
                        await self.drop_slots()
                        self.slots = [asyncio.ensure_future(self.submit_unfollowed(producer, rate))]
                    case "window":
                        now = time.process_time()
                        self.window.cpu_s = now - self.cpu
                        self.control.send(("window", self.window))
                        self.window, self.cpu = LoadWindow(0.0, 0, 0, 0), now
                    case "stop":
                        await self.drop_slots()
                        self.control.send(("stopped", None))
                        return

    async def drop_slots(self) -> None:
        """Every slot ends now. None starts another request, even one whose cancel reached it as
        its stream's timeout (asyncio.timeout can take a cancel for its own on Python 3.11)."""
        self.target = 0
        for slot in self.slots:
            slot.cancel()
        await asyncio.gather(*self.slots, return_exceptions=True)

    def resize(self, producer: AsyncProducer, target: int) -> None:
        """Slots past the target end after their request; new ones start at once."""
        self.target = target
        self.slots = [slot for slot in self.slots if not slot.done()]
        for index in range(len(self.slots), target):
            self.slots.append(asyncio.ensure_future(self.slot(producer, index)))

    async def slot(self, producer: AsyncProducer, index: int) -> None:
        while index < self.target:
            prompt, params = self.scenario.request(self.rng)
            try:
                handle = await producer.submit(prompt_ids=prompt, params=params)
                async for event in producer.stream(handle.id, timeout=STREAM_TIMEOUT_S):
                    if isinstance(event, TokenEvent):
                        self.window.events += 1
                        self.window.tokens += len(event.ids)
                    elif isinstance(event, DoneEvent):
                        self.window.completed += 1
                    elif isinstance(event, ErrorEvent):
                        self.failed(event.code)
            except (ProducerError, TimeoutError) as error:
                self.failed(type(error).__name__)

    async def submit_unfollowed(self, producer: AsyncProducer, rate: float) -> None:
        loop = asyncio.get_running_loop()
        due = loop.time()
        while True:
            prompt, params = self.scenario.request(self.rng)
            try:
                await producer.submit(prompt_ids=prompt, params=params)
            except ProducerError as error:
                self.failed(type(error).__name__)
            due += 1 / rate
            await asyncio.sleep(max(0.0, due - loop.time()))

    def failed(self, reason: str) -> None:
        self.window.failures[reason] = self.window.failures.get(reason, 0) + 1
