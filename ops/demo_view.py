"""The demo's client half: submit the prompts, stream them live (one panel per request),
and sum up what the client saw: TTFT, inter-token latency, throughput.

Kept apart from the process handling in ops/demo.py so that it runs against any worker,
the fake one in the tests included."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

from rich.console import Console, Group
from rich.markup import escape
from rich.live import Live
from rich.panel import Panel
from rich.table import Table
from rich.text import Text

from ops.percentile import percentile
from producer import AsyncProducer, DoneEvent, ErrorEvent, TokenEvent

CHAT_PROMPTS: list[tuple[str, str, dict]] = [  # (label, user message, sampling params)
    ("capital", "What is the capital of France? Answer in one sentence.", {"max_tokens": 40}),
    ("rhymes", "Give me three words that rhyme with cat.", {"max_tokens": 40}),
    ("greeting", "How do you say good morning in Spanish?", {"max_tokens": 40}),
    ("arithmetic", "What is 12 times 12?", {"max_tokens": 40}),
    ("story", "Write a short story about a robot who learns to paint.", {"max_tokens": 160}),
    ("rainbow", "Explain how a rainbow forms, step by step.", {"max_tokens": 160}),
]


@dataclass
class Watched:
    """One request as the client saw it (perf_counter seconds)."""

    label: str
    lane: str
    submitted: float
    arrivals: list[tuple[float, int]] = field(default_factory=list)  # (arrival, tokens) per token event
    text: str = ""
    end: DoneEvent | ErrorEvent | None = None

    @property
    def tokens(self) -> int:
        return sum(count for _, count in self.arrivals)

    @property
    def ttft(self) -> float | None:
        return self.arrivals[0][0] - self.submitted if self.arrivals else None

    @property
    def inter_token_latencies(self) -> list[float]:
        """Gap between token events, shared out over the tokens of the later one."""
        return [(later - earlier) / count
                for (earlier, _), (later, count) in zip(self.arrivals, self.arrivals[1:]) if count]


async def watch_prompts(producer: AsyncProducer, prompts, console: Console,
                        timeout: float) -> tuple[list[Watched], float]:
    """Submit every prompt, follow all streams at once; return them and the wall time."""
    started = time.perf_counter()
    watched: list[Watched] = []
    handles = []
    for label, message, params in prompts:
        handle = await producer.submit(messages=[{"role": "user", "content": message}],
                                       params={"temperature": 0.7, "seed": len(watched), **params})
        watched.append(Watched(label, handle.lane, time.perf_counter()))
        handles.append(handle)

    async def follow(handle, seen: Watched) -> None:
        async for event in handle.stream(timeout):
            if isinstance(event, TokenEvent):
                seen.arrivals.append((time.perf_counter(), len(event.ids)))
                seen.text += event.text
            else:
                seen.end = event

    # While streaming, each panel shows the tail of its text so that all of them fit on
    # the screen (Live cannot redraw what scrolled off); the last frame shows everything.
    crop = (max(2, console.size.height // max(1, len(watched)) - 2), max(20, console.width - 4))
    with Live(panels(watched, crop), console=console, refresh_per_second=8,
              vertical_overflow="visible") as live:
        follows = asyncio.gather(*(follow(handle, seen) for handle, seen in zip(handles, watched)))
        while not follows.done():
            await asyncio.wait([follows], timeout=0.125)
            live.update(panels(watched, crop))
        live.update(panels(watched))
        follows.result()  # re-raise what a stream raised
    return watched, time.perf_counter() - started


def panels(watched: list[Watched], crop: tuple[int, int] | None = None) -> Group:
    """One panel per request; `crop` = (lines, line width): show only the text's tail."""
    # Text, not a str: model output is not rich markup ("[1]", "[/INST]" ...).
    return Group(*(Panel(Text(_tail(seen.text.strip(), *crop) if crop else seen.text.strip()),
                         title=f"{seen.label} · {seen.lane}", title_align="left",
                         subtitle=_status(seen), subtitle_align="right")
                   for seen in watched))


def _tail(text: str, lines: int, line_width: int) -> str:
    """About the last `lines` screen lines of `text` (paragraph breaks and wrapping)."""
    kept = text.splitlines()[-lines:]
    cropped = "\n".join(kept)[-lines * line_width:]
    return cropped if cropped == text else "…" + cropped.lstrip()


def _status(seen: Watched) -> str:
    if isinstance(seen.end, ErrorEvent):
        return f"[red]{escape(f'{seen.end.code}: {seen.end.message}')}[/]"
    if isinstance(seen.end, DoneEvent):
        return f"[green]{seen.end.finish_reason}[/] · {seen.tokens} tokens"
    return f"[yellow]streaming[/] · {seen.tokens} tokens" if seen.arrivals else "[dim]queued[/]"


def summary(watched: list[Watched], wall: float) -> Group:
    ttfts = [seen.ttft for seen in watched if seen.ttft is not None]
    latencies = [gap for seen in watched for gap in seen.inter_token_latencies]
    queued = [seen.end.timings.queued for seen in watched if isinstance(seen.end, DoneEvent)]
    tokens = sum(seen.tokens for seen in watched)
    table = Table("", "p50", "p90", "max", title="summary (as the client saw it)", title_justify="left")
    for name, values, unit in (("TTFT (s)", ttfts, 1.0), ("inter-token latency (ms)", latencies, 1000.0),
                               ("queued in the worker (s)", queued, 1.0)):
        table.add_row(name, *(_show(percentile(values, q), unit) for q in (0.5, 0.9, 1.0)))
    failed = sum(1 for seen in watched if not isinstance(seen.end, DoneEvent) or seen.end.finish_reason == "error")
    return Group(table, f"{len(watched)} requests ({failed} failed), {tokens} tokens in {wall:.1f} s: "
                        f"[bold]{tokens / wall if wall > 0 else 0:.1f} tokens/s[/]")


def _show(value: float | None, unit: float) -> str:
    return "-" if value is None else f"{value * unit:.3f}" if unit == 1.0 else f"{value * unit:.1f}"
