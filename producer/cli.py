"""python -m producer: submit, stream, wait for, cancel requests; show the queues.

    python -m producer submit "Why is the sky blue?" --chat --stream --max-tokens 64
    python -m producer submit "The sky is" --stream --max-tokens 8 --logprobs 3
    python -m producer result ID          python -m producer stats
    python -m producer pin support-bot --system "You are a support agent."    (unpin NAME, pins)

Text goes to stdout as it arrives (pipe-friendly); ids, summaries, logprobs and errors go
to stderr. Exit status: 0 done, 1 the request ended in an error or the producer refused /
failed / timed out, 2 bad command line, 130 interrupted, 141 stdout closed early (`| head`).
Every failure is one `error:` line on stderr, never a traceback.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import tempfile
import time
from pathlib import Path

import msgspec
import redis
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from producer.acl import tenant_user
from producer.client import Producer
from producer.completion import Completion
from producer.connect import add_cluster_flag
from producer.errors import Disconnected, ProducerError
from producer.protocol import (DEFAULT_TENANT, LANES, MAX_SHARDS, PASSWORD_ON_COMMAND_LINE, DoneEvent, ErrorEvent,
                               TokenEvent, TokenLogprob, check_tenant, has_password, read_password, redacted)
from producer.shell import DEFAULT_URL, TENANT_ENV
from producer.tenants import TenantRegistry


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    errors = Console(stderr=True, highlight=False)
    if args.redis_url is not None and has_password(args.redis_url):
        errors.print(f"[yellow]warning:[/] {PASSWORD_ON_COMMAND_LINE}")
    args.redis_url = args.redis_url or os.environ.get("STREAMBATCH_REDIS_URL") or DEFAULT_URL
    try:
        password = read_password(args.redis_password_file) if args.redis_password_file else None
    except (OSError, ValueError) as error:
        errors.print(f"[red]error:[/] --redis-password-file: {escape(str(error))}")
        return 1
    try:
        producer = Producer(args.redis_url, tenant=args.tenant, prefix=args.prefix, password=password,
                            cluster=args.redis_cluster)
    except ValueError as error:  # redis-py's word on a URL it cannot parse
        errors.print(f"[red]error:[/] bad --redis-url {escape(repr(redacted(args.redis_url)))}: {escape(str(error))}")
        return 1
    try:
        with producer:
            status = args.run(producer, args, errors)
            sys.stdout.flush()  # a reader gone away shows here, not as noise at exit
            return status
    except Disconnected as error:
        errors.print(f"[red]error:[/] cannot reach Redis at {escape(redacted(args.redis_url))}: {escape(str(error))}")
    except (ProducerError, TimeoutError) as error:
        errors.print(f"[red]error:[/] {escape(str(error))}")
    except redis.RedisError as error:  # e.g. an out-of-range DB index, a refused AUTH
        errors.print(f"[red]error:[/] Redis at {escape(redacted(args.redis_url))} refused: {escape(str(error))}")
    except BrokenPipeError:
        return _stdout_closed()
    except KeyboardInterrupt:
        return 130
    return 1


def _stdout_closed() -> int:
    """stdout's reader went away (`... | head`): exit quietly as well-behaved CLIs do, with
    128 + SIGPIPE, and point stdout at /dev/null so that Python's flush at exit stays quiet too."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError):  # stdout without a file descriptor (captured): nothing to flush at exit
        pass
    return 141


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m producer", description=__doc__.split("\n")[0])
    # The environment's value is read after parsing, never made the default: --help would print it.
    parser.add_argument("--redis-url", type=_utf8, help=f"default: $STREAMBATCH_REDIS_URL, else {DEFAULT_URL}")
    parser.add_argument("--redis-password-file", default=os.environ.get("STREAMBATCH_REDIS_PASSWORD_FILE"),
                        help="a file holding the Redis password, in place of one in the URL "
                             "(default: $STREAMBATCH_REDIS_PASSWORD_FILE)")
    add_cluster_flag(parser)
    parser.add_argument("--prefix", default="sb", type=_utf8, help="key prefix shared with the workers")
    parser.add_argument("--tenant", type=_tenant, default=os.environ.get(TENANT_ENV) or DEFAULT_TENANT,
                        help=f"whose requests these are (default: ${TENANT_ENV}, else {DEFAULT_TENANT})")
    commands = parser.add_subparsers(required=True, metavar="COMMAND")

    submit = commands.add_parser("submit", help="enqueue a request; print its id, or --stream it")
    submit.add_argument("text")
    submit.add_argument("--chat", action="store_true", help="send as a user message (chat template)")
    submit.add_argument("--stream", action="store_true", help="print the text as it is generated")
    submit.add_argument("--max-tokens", type=int, default=256)
    submit.add_argument("--temperature", type=float, default=1.0)
    submit.add_argument("--seed", type=int)
    submit.add_argument("--logprobs", type=int, metavar="N",
                        help="show each token's logprob and the N most likely tokens (0: its own only)")
    submit.add_argument("--lane", choices=LANES, help="default: the lane rule decides")
    submit.add_argument("--id", help="request id (default: generated); submitting an id twice runs it once")
    submit.add_argument("--timeout", type=float, help="with --stream: give up after this many seconds")
    submit.set_defaults(run=_submit)

    for name, run, what in (("stream", _stream, "print a request's text as it is generated"),
                            ("result", _result, "wait for a request and print its text")):
        command = commands.add_parser(name, help=what)
        command.add_argument("id")
        command.add_argument("--timeout", type=float)
        if name == "result":
            command.add_argument("--json", action="store_true", help="print the whole completion as JSON")
        command.set_defaults(run=run)

    cancel = commands.add_parser("cancel", help="ask the worker to stop a request")
    cancel.add_argument("id")
    cancel.set_defaults(run=_cancel)

    stats = commands.add_parser("stats", help="lane backlogs, pending, live workers, dead letters")
    stats.add_argument("--json", action="store_true")
    stats.set_defaults(run=_stats)

    pin = commands.add_parser("pin", help="have every worker keep a prefix in its KV cache, never evicted")
    pin.add_argument("name", help="names the pin (letters, digits, _ and -); pinning it again replaces it")
    prefix = pin.add_mutually_exclusive_group(required=True)
    prefix.add_argument("--text", help="a text prefix, tokenized as a prompt is")
    prefix.add_argument("--system", metavar="TEXT",
                        help="a system prompt, rendered with the chat template as chat requests that start with it are")
    prefix.add_argument("--messages", type=_messages, metavar="JSON",
                        help="the leading messages of chat requests, as a JSON list of {role, content}")
    prefix.add_argument("--ids", type=_token_ids, metavar="ID,ID,...", help="token ids, comma-separated")
    pin.set_defaults(run=_pin)
    unpin = commands.add_parser("unpin", help="let a pinned prefix be evicted again")
    unpin.add_argument("name")
    unpin.set_defaults(run=_unpin)
    pins = commands.add_parser("pins", help="the pinned prefixes")
    pins.add_argument("--json", action="store_true")
    pins.set_defaults(run=_pins)

    tenant = commands.add_parser("tenant", help="the tenant registry, their Redis users and API keys (operator)")
    actions = tenant.add_subparsers(required=True, metavar="ACTION")
    add = actions.add_parser("add", help="register a tenant: its Redis user, its API key (shown once)")
    add.add_argument("name", type=_tenant)
    add.add_argument("--weight", type=float, default=1.0, help="its share of the fleet (default %(default)s)")
    add.add_argument("--max-backlog", type=int, default=10_000, help="per lane (default %(default)s)")
    add.add_argument("--shards", type=int, default=1,
                     help=f"intake streams per lane, to spread over a cluster's nodes (1-{MAX_SHARDS}; default 1)")
    add.add_argument("--max-running", type=int, help="its sequences one worker runs at once (default: no limit)")
    change = actions.add_parser("set", help="change a tenant's weight or quotas (workers apply them within a heartbeat)")
    change.add_argument("name", type=_tenant)
    change.add_argument("--weight", type=float, help="its share of the fleet against the others'")
    change.add_argument("--max-backlog", type=int, help="requests waiting or running per lane")
    change.add_argument("--max-running", type=int, help="its sequences one worker runs at once")
    change.set_defaults(run=_tenant_set)
    rotate = actions.add_parser("rotate-key", help="new Redis password and API key; the old ones stop at once")
    rotate.add_argument("name", type=_tenant)
    for issuing, adding in ((add, True), (rotate, False)):
        issuing.add_argument("--password-file", required=True, type=Path,
                             help="where the tenant's new Redis password goes (made with mode 0600; never printed)")
        issuing.set_defaults(run=_tenant_issue, adding=adding)
    reshard = actions.add_parser("reshard", help="spread a tenant's new requests over N intake streams per lane "
                                                 "(safe with requests in flight)")
    reshard.add_argument("name", type=_tenant)
    reshard.add_argument("shards", type=int, help=f"1-{MAX_SHARDS}")
    reshard.set_defaults(run=_tenant_reshard)
    remove = actions.add_parser("remove", help="unregister a tenant and delete its Redis user")
    remove.add_argument("name", type=_tenant)
    remove.set_defaults(run=_tenant_remove)
    listing = actions.add_parser("list", help="the registered tenants")
    listing.add_argument("--json", action="store_true")
    listing.set_defaults(run=_tenant_list)
    return parser


def _tenant(value: str) -> str:
    try:
        return check_tenant(value)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def _utf8(value: str) -> str:
    """Text that goes into connection settings or key names as is. (Prompt text is the
    producer's to refuse: InvalidRequest names the field.)"""
    try:
        value.encode()
    except UnicodeEncodeError:
        raise argparse.ArgumentTypeError(f"not valid UTF-8: {value!r:.80}") from None
    return value


def _messages(value: str) -> list[dict]:
    try:
        return msgspec.json.decode(value)
    except msgspec.DecodeError as error:
        raise argparse.ArgumentTypeError(f"not JSON: {error}") from None


def _token_ids(value: str) -> list[int]:
    try:
        return [int(token) for token in value.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated token ids, got {value!r:.80}") from None


def _submit(producer: Producer, args, errors: Console) -> int:
    params = {"max_tokens": args.max_tokens, "temperature": args.temperature, "seed": args.seed,
              "logprobs": args.logprobs}
    prompt = {"messages": [{"role": "user", "content": args.text}]} if args.chat else {"prompt": args.text}
    handle = producer.submit(**prompt, params={k: v for k, v in params.items() if v is not None},
                             lane=args.lane, request_id=args.id)
    if not args.stream:
        print(handle.id)
        return 0
    again = ", submitted before" if handle.duplicate else ""
    errors.print(f"[dim]{handle.id} ({handle.lane} lane{again})[/]")
    try:
        return _print_stream(producer, handle.id, args.timeout, errors)
    except KeyboardInterrupt:
        producer.cancel(handle.id)  # nobody is left to read it: free the worker
        errors.print(f"\n[yellow]interrupted: cancelled {handle.id}[/]")
        return 130
    except BrokenPipeError:
        producer.cancel(handle.id)  # likewise
        raise


def _stream(producer: Producer, args, errors: Console) -> int:
    return _print_stream(producer, args.id, args.timeout, errors)


def _print_stream(producer: Producer, request_id: str, timeout: float | None, errors: Console) -> int:
    started = time.monotonic()
    token_ids: list[int] = []
    logprobs: list[TokenLogprob] = []
    for event in producer.stream(request_id, timeout):
        if isinstance(event, TokenEvent):
            sys.stdout.write(printable(event.text))
            sys.stdout.flush()
            token_ids += event.ids
            logprobs += event.logprobs or ()
        elif isinstance(event, DoneEvent):
            print()
            _print_logprobs(token_ids, logprobs, errors)
            errors.print(f"[dim]\\[{event.finish_reason} · {event.usage.completion_tokens} tokens · "
                         f"TTFT {event.timings.ttft:.2f} s · total {event.timings.total:.2f} s · "
                         f"watched {time.monotonic() - started:.2f} s][/]")
            if event.error:
                errors.print(f"[red]error:[/] {escape(printable(event.error))}")
            return 1 if event.finish_reason == "error" else 0
        elif isinstance(event, ErrorEvent):
            print()
            _print_logprobs(token_ids, logprobs, errors)
            errors.print(f"[red]error:[/] {escape(printable(f'{event.code}: {event.message}'))}")
            return 1
    raise AssertionError("a stream always ends with a terminal event")


def _result(producer: Producer, args, errors: Console) -> int:
    completion = producer.result(args.id, args.timeout)
    if args.json:
        print(msgspec.json.encode(completion).decode())
    else:
        print(printable(completion.text))
        _print_logprobs(completion.token_ids, completion.logprobs or [], errors)
        errors.print(f"[dim]{escape(printable(_summary(completion)))}[/]")
    return 0 if completion.ok else 1


def _print_logprobs(token_ids: list[int], logprobs: list[TokenLogprob], errors: Console) -> None:
    """One row per generated token: its text, id and logprob, and the most likely tokens."""
    if not logprobs:
        return
    top_n = max(len(entry.top) for entry in logprobs)
    table = Table("#", "token", "id", "logprob", title="logprobs", show_lines=bool(top_n))
    if top_n:  # logprobs=0 asked for the chosen tokens' own only
        table.add_column(f"top {top_n}")
    for i, (token_id, entry) in enumerate(zip(token_ids, logprobs)):
        cells = [str(i), escape(_token_text(entry.text, token_id)), str(token_id), f"{entry.logprob:.3f}"]
        if top_n:
            alternatives = Table.grid(padding=(0, 2))  # one per line: a token's text may hold spaces
            alternatives.add_column()
            alternatives.add_column(justify="right")
            for alt in entry.top:
                alternatives.add_row(escape(_token_text(alt.text, alt.id)), f"{alt.logprob:.3f}")
            cells.append(alternatives)
        table.add_row(*cells)
    errors.print(table)


# What a terminal would act on rather than show: C0 and C1 controls (ESC starts the sequences that
# move the cursor, retitle the window or rewrite earlier lines) but newline and tab, and the
# bidirectional overrides that reorder what is shown.
_CONTROLS = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f\u202a-\u202e\u2066-\u2069]")


def printable(text: str) -> str:
    """Generated text as it is safe to write to a terminal: model output is anyone's input."""
    return _CONTROLS.sub("", text)


def _token_text(text: str, token_id: int) -> str:
    """Quoted, so that spaces and newlines show; the id where the worker had no tokenizer."""
    return repr(text) if text else f"#{token_id}"


def _summary(completion: Completion) -> str:
    if completion.error:
        return f"error: {completion.error}"
    return (f"[{completion.finish_reason} · {completion.usage.completion_tokens} tokens · "
            f"TTFT {completion.timings.ttft:.2f} s · total {completion.timings.total:.2f} s]")


def _tenant_issue(producer: Producer, args, errors: Console) -> int:
    registry = TenantRegistry(producer.redis, producer.keys)
    adding = args.adding
    # A new file (mode 0600) made before anything is issued, since credentials that could not be
    # saved would be lost at once; it replaces the old one only once the new credentials exist.
    target = Path(args.password_file)
    try:
        descriptor, scratch = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.")
    except OSError as error:
        errors.print(f"[red]error:[/] --password-file: {escape(str(error))}")
        return 1
    try:
        with os.fdopen(descriptor, "w") as out:
            if adding:
                issued = registry.add(args.name, weight=args.weight, max_backlog=args.max_backlog,
                                      shards=args.shards, max_running=args.max_running)
            else:
                issued = registry.rotate_key(args.name)
            out.write(issued.password + "\n")
        os.replace(scratch, target)
    except ValueError as error:
        errors.print(f"[red]error:[/] {escape(str(error))}")
        return 1
    finally:
        Path(scratch).unlink(missing_ok=True)
    print(issued.api_key)  # stdout, once: the one place it is shown
    errors.print(f"{'registered' if adding else 'new credentials for'} tenant {issued.tenant}\n"
                 f"  Redis: {escape(redacted(args.redis_url))} as user {issued.username}, password in "
                 f"{escape(str(args.password_file))} (STREAMBATCH_REDIS_PASSWORD_FILE)\n"
                 f"  tenant: STREAMBATCH_TENANT={issued.tenant}\n"
                 "  gateway API key: printed above, once; only its SHA-256 is kept", soft_wrap=True)  # paths whole
    if not issued.persisted:
        errors.print("[yellow]warning:[/] this Redis has no ACL file: the user lasts until it restarts")
    return 0


def _tenant_set(producer: Producer, args, errors: Console) -> int:
    changes = {name: value for name in ("weight", "max_backlog", "max_running")
               if (value := getattr(args, name)) is not None}
    if not changes:
        errors.print("[red]error:[/] nothing to change: give --weight, --max-backlog or --max-running")
        return 1
    try:
        entry = TenantRegistry(producer.redis, producer.keys).update(args.name, **changes)
    except ValueError as error:
        errors.print(f"[red]error:[/] {escape(str(error))}")
        return 1
    errors.print(f"tenant {args.name}: weight {entry.weight:g}, max backlog {entry.max_backlog}, max running "
                 f"{entry.max_running or 'no limit'} (workers apply it within a heartbeat)")
    return 0


def _tenant_reshard(producer: Producer, args, errors: Console) -> int:
    try:
        entry = TenantRegistry(producer.redis, producer.keys).reshard(args.name, args.shards)
    except ValueError as error:
        errors.print(f"[red]error:[/] {escape(str(error))}")
        return 1
    errors.print(f"tenant {args.name}: new requests over {entry.shards} shard(s) per lane; workers read "
                 f"{entry.max_shards} (every shard it has had, so nothing enqueued before is stranded)")
    return 0


def _tenant_remove(producer: Producer, args, errors: Console) -> int:
    try:
        persisted = TenantRegistry(producer.redis, producer.keys).remove(args.name)
    except ValueError as error:
        errors.print(f"[red]error:[/] {escape(str(error))}")
        return 1
    errors.print(f"removed tenant {args.name}: its Redis user is gone; workers serve what its streams hold "
                 "until they restart")
    if not persisted:
        errors.print("[yellow]warning:[/] this Redis has no ACL file: the change lasts until it restarts")
    return 0


def _tenant_list(producer: Producer, args, errors: Console) -> int:
    registered = TenantRegistry(producer.redis, producer.keys).list()
    if args.json:
        print(msgspec.json.encode([{"tenant": entry.tenant, "weight": entry.entry.weight,
                                    "max_backlog": entry.entry.max_backlog, "shards": entry.entry.shards,
                                    "max_running": entry.entry.max_running, "user": entry.has_user}
                                   for entry in registered]).decode())
        return 0
    table = Table("tenant", "weight", "max backlog", "shards", "Redis user", title="tenants")
    for entry in registered:
        table.add_row(entry.tenant, f"{entry.entry.weight:g}", str(entry.entry.max_backlog),
                      str(entry.entry.shards) + (f" (reads {entry.entry.max_shards})"
                                                 if entry.entry.max_shards > entry.entry.shards else ""),
                      tenant_user(entry.tenant) if entry.has_user else "[yellow]missing[/]")
    Console(highlight=False).print(table)
    return 0


def _cancel(producer: Producer, args, errors: Console) -> int:
    producer.cancel(args.id)
    errors.print(f"cancel requested for {args.id}")
    return 0


def _stats(producer: Producer, args, errors: Console) -> int:
    stats = producer.stats()
    if args.json:
        print(msgspec.json.encode(stats).decode())
        return 0
    lanes = Table("lane", "backlog", "pending", title=f"lanes of tenant {producer.keys.tenant}")
    for lane, lane_stats in stats.lanes.items():
        lanes.add_row(lane, str(lane_stats.backlog), str(lane_stats.pending))
    out = Console(highlight=False)
    if stats.workers is None:
        out.print(lanes, "workers and dead letters: the operator's to see (this Redis user may not read them)")
        return 0
    workers = Table("worker", "state", "model", "running", "waiting", "KV", "tokens/s", "up",
                    title="live workers")
    for worker in stats.workers:
        workers.add_row(escape(worker.name), escape(worker.state or "?"), escape(worker.model or "?"),
                        _show(worker.running), _show(worker.waiting), _show(worker.kv_usage, "{:.0%}"),
                        _show(worker.tokens_per_s, "{:.1f}"), _show(worker.uptime, "{:.0f} s"))
    out.print(lanes, workers if stats.workers else "[yellow]no live workers[/]")
    for worker in stats.workers:
        if worker.state == "starting" and worker.phase:
            out.print(f"{escape(worker.name)} is starting: {escape(worker.phase)}")
    out.print(f"dead letters: {stats.dead_letters}")
    return 0


def _pin(producer: Producer, args, errors: Console) -> int:
    messages = [{"role": "system", "content": args.system}] if args.system is not None else args.messages
    producer.pin(args.name, args.text, messages=messages, prompt_ids=args.ids)
    errors.print(f"pinned {escape(args.name)}: every worker applies it within a heartbeat, in whole KV blocks "
                 "(a worker that cannot keep it logs pin.refused)")
    return 0


def _unpin(producer: Producer, args, errors: Console) -> int:
    if not producer.unpin(args.name):
        errors.print(f"[red]error:[/] no prefix named {escape(args.name)} is pinned")
        return 1
    errors.print(f"unpinned {escape(args.name)}")
    return 0


def _pins(producer: Producer, args, errors: Console) -> int:
    pins = producer.pins()
    if args.json:
        print(msgspec.json.encode({name: _pinned_prefix(request) for name, request in pins.items()}).decode())
        return 0
    if not pins:
        errors.print("no pinned prefixes")
        return 0
    table = Table("name", "kind", "prefix", title="pinned prefixes")
    for name, request in pins.items():
        kind, prefix = next(iter(_pinned_prefix(request).items()))
        shown = (f"{len(prefix)} token ids" if kind == "prompt_ids" else
                 f"{len(prefix)} messages: {prefix[0]['content']}" if kind == "messages" else prefix)
        table.add_row(escape(name), kind, escape(shown if len(shown) <= 80 else shown[:77] + "..."))
    Console(highlight=False).print(table)
    return 0


def _pinned_prefix(request) -> dict:
    """The one prompt field of a published pin: {"prompt": ...}, {"messages": ...} or {"prompt_ids": ...}."""
    return {name: value for name, value in msgspec.to_builtins(request).items()
            if name in ("prompt", "messages", "prompt_ids")}


def _show(value, style: str = "{}") -> str:
    return "-" if value is None else style.format(value)
