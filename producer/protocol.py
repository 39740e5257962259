"""The wire contract shared by producer and worker: THE one place both sides import.

Requests, events, sampling parameters, the lane rule and every Redis key name. Every
struct is a msgspec Struct sent as msgpack; `__post_init__` validates on construction and
on decoding alike, so a bad value is refused with a clear message wherever it enters.
"""

from __future__ import annotations

import math
import re
import socket
import ssl
import time
import uuid
from pathlib import Path
from typing import Annotated, Literal
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

import msgspec

Lane = Literal["fast", "normal"]
LANES: tuple[Lane, ...] = ("fast", "normal")
# What a worker's heartbeat (`Keys.worker`) says it is doing: loading (with the phase it is in),
# serving, or draining after SIGTERM. Only a ready worker takes requests.
WorkerState = Literal["starting", "ready", "draining"]

# The lane rule's defaults; the worker's config may override them.
FAST_PROMPT_TOKENS = 256
FAST_MAX_TOKENS = 128

# What one request may carry, for both sides: the producer refuses more before it enqueues, the
# worker before it decodes (entry size) or as it decodes (msgspec checks lengths as it reads), so
# that no entry costs a worker's loop more than a few milliseconds before it is refused. Larger
# than any model here can take (its max_model_len refuses what is left, before tokenizing).
MAX_ENTRY_BYTES = 4 * 2**20  # an encoded request, as XADDed
MAX_PROMPT_CHARS = 2**20  # a prompt's text, and all of a conversation's message contents together
MAX_MESSAGES = 2048
MAX_PROMPT_IDS = 2**20
MAX_STOP_STRINGS, MAX_STOP_CHARS = 16, 256  # stop strings, and the length of each
MAX_STOP_TOKEN_IDS = 64
MAX_TOKENS = 2**20  # max_tokens; the worker also refuses what leaves no room in its model length


class SamplingParams(msgspec.Struct, forbid_unknown_fields=True, omit_defaults=True):
    """How one request is sampled and when it stops (names follow vLLM's)."""

    max_tokens: int = 256
    temperature: float = 1.0
    top_k: int = 0  # 0 = disabled
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    stop: Annotated[list[Annotated[str, msgspec.Meta(max_length=MAX_STOP_CHARS)]],
                    msgspec.Meta(max_length=MAX_STOP_STRINGS)] = msgspec.field(default_factory=list)
    stop_token_ids: Annotated[list[int], msgspec.Meta(max_length=MAX_STOP_TOKEN_IDS)] = msgspec.field(
        default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None  # top-n logprobs to return per token

    def __post_init__(self) -> None:
        problems = _sampling_problems(self)
        if problems:
            raise ValueError("invalid sampling params: " + "; ".join(problems))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def has_penalties(self) -> bool:
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0


def _sampling_problems(p: SamplingParams) -> list[str]:
    checks = [
        (1 <= p.max_tokens <= MAX_TOKENS, f"max_tokens must be in [1, {MAX_TOKENS}], got {p.max_tokens}"),
        (0.0 <= p.temperature <= 100.0, f"temperature must be in [0, 100], got {p.temperature}"),
        (p.top_k >= 0, f"top_k must be >= 0 (0 disables), got {p.top_k}"),
        (0.0 < p.top_p <= 1.0, f"top_p must be in (0, 1], got {p.top_p}"),
        (0.0 <= p.min_p <= 1.0, f"min_p must be in [0, 1], got {p.min_p}"),
        (0.0 < p.repetition_penalty <= 10.0,
         f"repetition_penalty must be in (0, 10], got {p.repetition_penalty}"),
        (-2.0 <= p.presence_penalty <= 2.0,
         f"presence_penalty must be in [-2, 2], got {p.presence_penalty}"),
        (-2.0 <= p.frequency_penalty <= 2.0,
         f"frequency_penalty must be in [-2, 2], got {p.frequency_penalty}"),
        (p.seed is None or 0 <= p.seed < 2**63, f"seed must be in [0, 2**63), got {p.seed}"),
        (all(isinstance(s, str) and s for s in p.stop), "stop strings must be non-empty"),
        (len(p.stop) <= MAX_STOP_STRINGS, f"at most {MAX_STOP_STRINGS} stop strings, got {len(p.stop)}"),
        (all(t >= 0 for t in p.stop_token_ids), "stop_token_ids must be >= 0"),
        (p.logprobs is None or 0 <= p.logprobs <= 20, f"logprobs must be in [0, 20], got {p.logprobs}"),
    ]
    return [message for ok, message in checks if not ok]


def pick_lane(
    prompt_tokens: int,
    max_tokens: int,
    requested: Lane | None = None,
    fast_prompt_tokens: int = FAST_PROMPT_TOKENS,
    fast_max_tokens: int = FAST_MAX_TOKENS,
) -> Lane:
    """Fast lane = short prompt and small max_tokens. A caller may ask for `normal`
    outright; a claim of `fast` that breaks the rule is demoted to `normal`."""
    if requested is not None and requested not in LANES:
        raise ValueError(f"unknown lane {requested!r}; expected one of {LANES}")
    qualifies = prompt_tokens <= fast_prompt_tokens and max_tokens <= fast_max_tokens
    if requested == "normal" or not qualifies:
        return "normal"
    return "fast"


FinishReason = Literal["stop", "length", "cancelled", "deadline", "error"]


class Usage(msgspec.Struct, frozen=True):
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0  # prompt tokens served from the prefix cache


class Timings(msgspec.Struct, frozen=True):
    """Seconds, measured by the worker from the request's arrival in the engine."""

    queued: float  # arrival -> first scheduled
    ttft: float  # arrival -> first token
    total: float  # arrival -> finish


# --- requests --------------------------------------------------------------------------
PROTOCOL_VERSION = 1
REQUEST_ID = re.compile(r"[A-Za-z0-9_-]{1,64}")  # ids end up inside key names
Role = Literal["system", "user", "assistant", "tool"]


def new_request_id() -> str:
    return uuid.uuid4().hex


def check_request_id(request_id: str) -> str:
    if not isinstance(request_id, str) or not REQUEST_ID.fullmatch(request_id):
        raise ValueError(f"request id must match [A-Za-z0-9_-]{{1,64}}, got {request_id!r:.80}")
    return request_id


class Message(msgspec.Struct, forbid_unknown_fields=True):
    role: Role
    content: Annotated[str, msgspec.Meta(max_length=MAX_PROMPT_CHARS)]


class Request(msgspec.Struct, forbid_unknown_fields=True, omit_defaults=True):
    """One generation request: exactly one of prompt / messages / prompt_ids."""

    id: str = msgspec.field(default_factory=new_request_id)
    prompt: Annotated[str, msgspec.Meta(max_length=MAX_PROMPT_CHARS)] | None = None
    messages: Annotated[list[Message], msgspec.Meta(max_length=MAX_MESSAGES)] | None = None
    prompt_ids: Annotated[list[int], msgspec.Meta(max_length=MAX_PROMPT_IDS)] | None = None
    params: SamplingParams = msgspec.field(default_factory=SamplingParams)
    lane: Lane | None = None  # None: the lane rule decides
    deadline: float | None = None  # unix seconds: not started by then -> finish reason "deadline"
    submitted_at: float = msgspec.field(default_factory=time.time)
    v: int = PROTOCOL_VERSION

    def __post_init__(self) -> None:
        check_request_id(self.id)
        if self.v != PROTOCOL_VERSION:
            raise ValueError(f"unsupported protocol version {self.v}; this side speaks {PROTOCOL_VERSION}")
        given = [name for name in ("prompt", "messages", "prompt_ids") if getattr(self, name) is not None]
        if len(given) != 1:
            raise ValueError(f"give exactly one of prompt, messages, prompt_ids; got {given or 'none'}")
        if self.prompt_ids is not None and any(t < 0 for t in self.prompt_ids):
            raise ValueError("prompt_ids must be non-negative token ids")
        # NaN never compares true: a NaN deadline would silently never expire
        for name in ("deadline", "submitted_at"):
            if (value := getattr(self, name)) is not None and not math.isfinite(value):
                raise ValueError(f"{name} must be a finite unix time, got {value}")
        # Each field's own length is checked as it is decoded (the Meta bounds); this one spans fields.
        if self.messages is not None and (chars := sum(len(m.content) for m in self.messages)) > MAX_PROMPT_CHARS:
            raise ValueError(f"messages: at most {MAX_PROMPT_CHARS} characters of content in all, got {chars}")


# --- events ----------------------------------------------------------------------------
class TopLogprob(msgspec.Struct, array_like=True, frozen=True):
    """One of the most likely tokens at a position; on the wire [id, logprob, text]."""

    id: int
    logprob: float
    text: str = ""


class TokenLogprob(msgspec.Struct, omit_defaults=True, frozen=True):
    """Logprobs of one generated token, from the model's raw distribution (before penalties,
    temperature and filters, as vLLM returns them): the chosen token's own, and with
    `logprobs=n > 0` the n most likely tokens, best first. Texts are each token decoded alone
    by the worker (the producer has no tokenizer), special tokens shown; a token that is part
    of a multi-byte character decodes to U+FFFD; "" for a model without a tokenizer."""

    logprob: float
    text: str = ""
    top: list[TopLogprob] = []


class TokenEvent(msgspec.Struct, tag="token", omit_defaults=True):
    """New tokens of a request. `seq` numbers every event of a request from 0; `attempt`
    counts deliveries (a request resumed on another worker continues the numbering).
    `logprobs`, when the request asked for them, has one entry per id, in order."""

    seq: int
    attempt: int
    ids: list[int]
    text: str
    logprobs: list[TokenLogprob] | None = None


class DoneEvent(msgspec.Struct, tag="done"):
    seq: int
    attempt: int
    finish_reason: FinishReason
    usage: Usage
    timings: Timings
    error: str | None = None


class ErrorEvent(msgspec.Struct, tag="error"):
    """The request failed or was refused; terminal, like DoneEvent."""

    seq: int
    attempt: int
    code: str  # invalid_request | too_long | queue_full | dead_letter | internal
    message: str


Event = TokenEvent | DoneEvent | ErrorEvent
TERMINAL = (DoneEvent, ErrorEvent)


SubmissionState = Literal["enqueuing", "queued", "rejected"]


class Submission(msgspec.Struct, frozen=True, omit_defaults=True):
    """The value of `Keys.submitted(id)`: the lane an id went to and how far it got. The
    producer writes "enqueuing" (short-lived) and then "queued" with the enqueue; a worker that
    dead-letters the request without an event (its replay stream is damaged, so no event can
    be numbered) writes "rejected" with the reason, so that consumers end instead of waiting."""

    lane: Lane
    state: SubmissionState = "queued"
    reason: str = ""
    by: str = ""  # a token of the submit call that wrote it: a retry inside that call knows its own claim

_request_decoder = msgspec.msgpack.Decoder(Request)
_event_decoder = msgspec.msgpack.Decoder(Event)
_submission_decoder = msgspec.msgpack.Decoder(Submission)
_encoder = msgspec.msgpack.Encoder()


def encode(message: Request | Event | Submission) -> bytes:
    return _encoder.encode(message)


def decode_request(data: bytes) -> Request:
    """Raises msgspec.DecodeError / msgspec.ValidationError with the reason."""
    return _request_decoder.decode(data)


def decode_event(data: bytes) -> Event:
    return _event_decoder.decode(data)


def decode_submission(data: bytes) -> Submission:
    return _submission_decoder.decode(data)


# --- connections -----------------------------------------------------------------------
REPLY_TIMEOUT_S = 10.0  # a reply (other than a blocking read's) slower than this: the connection is dead
CONNECT_TIMEOUT_S = 5.0
HEALTH_CHECK_S = 15  # a connection idle this long is PINGed before use (pub/sub ones too)
_KEEPALIVE = {"TCP_KEEPIDLE": 10, "TCP_KEEPINTVL": 5, "TCP_KEEPCNT": 3}  # a silent peer is dropped in ~25 s


def connection_options(blocking_ms: int = 0, password: str | None = None) -> dict:
    """What every Redis connection of either side is opened with (redis-py's from_url keyword
    arguments), so that none waits for ever on a half-open TCP connection: explicit reply and
    connect timeouts (a connection for BLOCK reads of up to `blocking_ms` waits that much longer),
    TCP keepalive, health checks. No automatic retry: redis-py would resend a command whose reply
    was lost, and a resent XADD, INCR or fenced write happens twice. Each caller retries at the
    level where it knows what a repeat means (a worker resumes from the replay stream, a stream
    re-reads it). `password` (from `read_password`) takes the place of one in the URL."""
    keepalive = {getattr(socket, name): value for name, value in _KEEPALIVE.items() if hasattr(socket, name)}
    return {"socket_timeout": REPLY_TIMEOUT_S + blocking_ms / 1000, "socket_connect_timeout": CONNECT_TIMEOUT_S,
            "socket_keepalive": True, "socket_keepalive_options": keepalive,
            "health_check_interval": HEALTH_CHECK_S, "retry": None} | ({"password": password} if password else {})


def is_tls_refusal(error: BaseException) -> bool:
    """A connection error that no retry cures because the TLS handshake failed: a server whose
    certificate the client does not trust, a client without the certificate a server asks for.
    (redis-py raises its ConnectionError while handling the ssl module's error.)"""
    cause = error.__cause__ or error.__context__
    if isinstance(cause, ssl.SSLCertVerificationError):
        return True
    # The server's alert: HANDSHAKE_FAILURE (TLS 1.2), CERTIFICATE_REQUIRED (1.3), BAD_CERTIFICATE,
    # UNKNOWN_CA. An EOF or a reset is a lost connection, retried: so under TLS 1.3 can a missing
    # client certificate look, when the server's close beats its alert.
    reason = getattr(cause, "reason", None) or ""
    return isinstance(cause, ssl.SSLError) and any(word in reason for word in ("CERTIFICATE", "UNKNOWN_CA",
                                                                                "HANDSHAKE_FAILURE"))


def read_password(path: str) -> str:
    """The Redis password kept in a file (a compose secret, /run/secrets/...), so that it is in
    neither a URL, an environment variable nor a command line; one trailing newline dropped.
    Raises OSError (naming the file) when it cannot be read, ValueError when it is empty."""
    password = Path(path).read_text().removesuffix("\n").removesuffix("\r")
    if not password:
        raise ValueError(f"the Redis password file {path} is empty")
    return password


def redacted(url: str) -> str:
    """A Redis URL fit to print or log: its password (in the user part or a `password=` query
    parameter) replaced by ***; a URL that does not parse is withheld whole."""
    try:
        parts = urlsplit(url)
        netloc = parts.netloc
        if parts.password is not None:
            user = parts.username or ""
            netloc = f"{user}:***@{netloc.rpartition('@')[2]}"
        query = urlencode([(name, "***" if name.lower() == "password" else value)
                           for name, value in parse_qsl(parts.query, keep_blank_values=True)], safe="*")
        shown = urlunsplit(parts._replace(netloc=netloc, query=query))
        if not netloc and url.startswith(f"{parts.scheme}://"):  # unix:///path keeps its slashes
            shown = f"{parts.scheme}://{shown[len(parts.scheme) + 1:]}"
        return shown
    except ValueError:
        return "<a Redis URL that does not parse>"


# Said wherever a password arrives in a --redis-url flag: any user of the machine reads a
# process's arguments (ps, /proc/<pid>/cmdline).
PASSWORD_ON_COMMAND_LINE = ("the password in --redis-url is visible to every user of this machine (ps): "
                            "give it in a file (--redis-password-file or $STREAMBATCH_REDIS_PASSWORD_FILE), "
                            "or the URL in $STREAMBATCH_REDIS_URL")


def has_password(url: str) -> bool:
    """Whether the URL carries a password (or might: one that does not parse)."""
    return redacted(url) != url


# --- Redis layout ----------------------------------------------------------------------
FIELD = b"m"  # the one field of a stream entry, holding an encoded request or event
GROUP = "workers"

# How long a request's keys live (seconds); see Keys for who sets each.
ENQUEUE_TTL_S = 10  # an id taken by a submit that has not enqueued yet: a producer that dies mid-way frees it
DEFAULT_CLAIM_TTL_S = 3600  # a queued id, and a cancel flag: the longest a request may wait and still be found
DEFAULT_REPLAY_TTL_S = 600  # a request's events (and the keys that go with them) after its last write


def ensure_group(client, stream: str) -> None:
    """Create the workers' group on a lane stream (and the stream) unless it exists, at id 0 so
    that entries enqueued before it, or before a deleted stream was made again, are delivered
    too. `client` is a redis-py client; the one place the group is made, by workers and tests
    (producers only XADD: a stream without its group yet is read once a worker makes it)."""
    try:
        client.xgroup_create(stream, GROUP, id="0", mkstream=True)
    except Exception as error:  # redis.ResponseError; this module does not import redis
        if "BUSYGROUP" not in str(error):
            raise


def is_missing_group(error: Exception) -> bool:
    """A Redis error that says a lane stream (or its group) is gone: NOGROUP, from any group
    command, a script's included (redis-py puts the pipeline's words before it)."""
    return "NOGROUP " in str(error)


TENANT = re.compile(r"[a-z0-9_-]{1,32}")  # tenant names end up inside key names and ACL rules
MAX_SHARDS = 64  # intake streams per (tenant, lane): each is a hash tag of its own, to spread over nodes
DEFAULT_TENANT = "default"  # the embedded start's one tenant, always served


def check_tenant(tenant: str) -> str:
    if not isinstance(tenant, str) or not TENANT.fullmatch(tenant):
        raise ValueError(f"tenant name must match [a-z0-9_-]{{1,32}}, got {tenant!r:.80}")
    return tenant


class Tenant(msgspec.Struct, omit_defaults=True):
    """A tenant's entry in the registry (`Keys.tenants`, name -> this as JSON), written by operators
    and read by every worker each heartbeat: the workers serve every registered tenant's lanes (and
    the default tenant's, registered or not)."""

    weight: float = 1.0  # its share of the fleet against other tenants'
    max_backlog: int = 10_000  # per lane, entries waiting or in flight
    api_key_sha256: str = ""  # of its gateway API key (producer/tenants.py), never the key itself
    shards: int = 1  # intake streams per lane that producers spread new requests over (Keys.requests)
    # The most shards it has had: workers read them all, so that what was enqueued before a reshard
    # down is served (the registry never lowers it).
    max_shards: int = 1
    max_running: int | None = None  # its sequences one worker runs at once (None: no limit)

    def __post_init__(self) -> None:
        if not (0 < self.weight <= 1000):
            raise ValueError(f"weight must be in (0, 1000], got {self.weight}")
        if self.max_backlog < 1:
            raise ValueError(f"max_backlog must be >= 1, got {self.max_backlog}")
        if self.max_running is not None and self.max_running < 1:
            raise ValueError(f"max_running must be >= 1 (or none), got {self.max_running}")
        if not 1 <= self.shards <= self.max_shards <= MAX_SHARDS:
            raise ValueError(f"shards must be in [1, {MAX_SHARDS}] and at most max_shards, "
                             f"got {self.shards} and {self.max_shards}")


_tenant_decoder = msgspec.json.Decoder(Tenant)


class TenantSettings(msgspec.Struct, frozen=True):
    """What a tenant's own producers read of its registry entry (Keys.settings): where to send new
    requests and how many may wait."""

    shards: int = 1
    max_backlog: int = 10_000


_settings_decoder = msgspec.json.Decoder(TenantSettings)


def decode_settings(data: bytes) -> TenantSettings:
    return _settings_decoder.decode(data)


def decode_tenant(data: bytes) -> Tenant:
    return _tenant_decoder.decode(data)


# In place of a tenant's name or a request id, while a name is made for an ACL pattern
# (producer/acl.py turns it into `*`): never a real one.
ANY_NAME = "\x00"


class Keys:
    """Every key and channel name (layout v2, see design.md): one tenant's, and the shared ones.

    A tenant's keys and channels all begin with `<prefix>:t:<tenant>:`, so one ACL rule per
    tenant covers them; the shared keys (dead letters, heartbeats, pins, the tenant registry)
    lie outside every tenant's prefix. Hash tags: a request's keys share `{<id>}` (one slot,
    so its scripts are atomic in Redis Cluster); each intake stream has one of its own, naming
    (tenant, lane, shard), so that streams spread over nodes.

    Lifetimes, and who sets them:
    - `requests(lane)`: an entry lives from the producer's XADD to the ack (XACK + XDEL) of the
      worker that ends the request; the stream itself is permanent.
    - `submitted(id)`: the producer's, ENQUEUE_TTL_S while it enqueues, then its claim TTL
      (DEFAULT_CLAIM_TTL_S); a worker that claims an id whose key lapsed sets it for the replay
      TTL; every event write keeps it at least as long as the replay stream, and the terminal
      one gives it exactly the replay stream's TTL.
    - `cancelled(id)`: the producer's cancel, for its claim TTL.
    - `attempt(id)`: set by every claim and never expiring while the entry is pending, so that
      no two claims of an entry hold the same attempt (the fence, see worker/claims.py); the ack
      gives it the replay TTL.
    - `replay(id)`: every event write sets its TTL to the worker's replay TTL (DEFAULT_REPLAY_TTL_S).
    - `worker(name)`: the heartbeat, a few seconds past the next beat.
    - `dead_letters`: trimmed to the workers' --dead-letter-ttl, and capped.
    - `pins`, `tenants`, `settings`: permanent, operator-managed.
    - `tokens(id)`, `cancel_channel`, `enqueued(lane, shard)`: channels, nothing stored.
    """

    def __init__(self, prefix: str = "sb", tenant: str = DEFAULT_TENANT) -> None:
        self.prefix, self.tenant = prefix, tenant if tenant == ANY_NAME else check_tenant(tenant)
        self.tenant_prefix = f"{prefix}:t:{tenant}:"
        self.cancel_channel = f"{self.tenant_prefix}cancel"
        self.dead_letters = f"{prefix}:dead"
        self.tenants = f"{prefix}:tenants"  # hash: the tenant registry, name -> Tenant as JSON

    def of(self, tenant: str) -> Keys:
        """The same layout for another tenant."""
        return self if tenant == self.tenant else Keys(self.prefix, tenant)

    def requests(self, lane: Lane, shard: int | str = 0) -> str:
        """The tenant's intake stream of a lane: one of its shards (Tenant.shards), each with a hash
        tag of its own, so that a busy (tenant, lane) spreads over a cluster's nodes."""
        return f"{self.tenant_prefix}req:{{{self.tenant}.{lane}.{shard}}}"

    def enqueued(self, lane: Lane, shard: int | str = 0) -> str:
        """On a cluster, the channel a producer nudges (SPUBLISH) after an enqueue on that stream, for
        idle workers (no read blocks across nodes): in the stream's slot, so a nudge goes to that
        shard's node alone, never over the whole cluster's bus."""
        return f"{self.tenant_prefix}enq:{{{self.tenant}.{lane}.{shard}}}"

    @property
    def settings(self) -> str:
        """The tenant's TenantSettings, for its producers, who may not read the registry: written by
        the operator beside the registry entry, read-only to the tenant (producer/acl.py)."""
        return f"{self.prefix}:settings:{self.tenant}"

    def v1_requests(self, lane: Lane) -> str:
        """The lane stream of layout v1 (no tenants), looked at only to refuse a start over it."""
        return f"{self.prefix}:req:{lane}"

    def tokens(self, request_id: str) -> str:
        return f"{self.tenant_prefix}{{{request_id}}}:tok"

    def replay(self, request_id: str) -> str:
        return f"{self.tenant_prefix}{{{request_id}}}:out"

    def cancelled(self, request_id: str) -> str:
        return f"{self.tenant_prefix}{{{request_id}}}:cancelled"

    def attempt(self, request_id: str) -> str:
        """Who owns the request now, "<attempt> <lane stream> <entry id>", set by the worker that
        claims it: a worker's event writes are refused unless the value is its own (fencing)."""
        return f"{self.tenant_prefix}{{{request_id}}}:attempt"

    def submitted(self, request_id: str) -> str:
        """The id's `Submission`: marks it taken (idempotent submit) while the request waits
        and runs, and after it finished as long as its replay stream lives."""
        return f"{self.tenant_prefix}{{{request_id}}}:submitted"

    def response(self, request_id: str) -> str:
        """The gateway's record of a Responses API request (producer/gateway/render.py's
        ResponseRecord), set once as it is submitted, for as long as its id may stay taken."""
        return f"{self.tenant_prefix}{{{request_id}}}:response"

    def worker(self, name: str) -> str:
        return f"{self.prefix}:worker:{name}"

    @property
    def workers_pattern(self) -> str:
        return f"{self.prefix}:worker:*"

    @property
    def pins(self) -> str:
        """Hash: the prefixes every worker keeps pinned, name -> an encoded Request whose prompt is
        the prefix (its params unused). Workers read it every heartbeat."""
        return f"{self.prefix}:pins"
