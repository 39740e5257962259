"""The gateway's HTTP application (Starlette; SSE by sse-starlette): OpenAI's Chat Completions,
Completions and Responses endpoints over one AsyncProducer, every tenant on its connections.

It keeps nothing of its own: a request is a streambatch request in Redis from the moment it is
accepted, a Responses request has a small record beside it (Keys.response), and every answer,
streamed or not, is read from the request's replay stream. So any replica serves any request,
and a response survives the gateway that took it.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass

import msgspec
import redis
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from sse_starlette import EventSourceResponse, ServerSentEvent
from starlette.applications import Starlette
from starlette.requests import Request as HTTPRequest
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from producer.async_client import AsyncProducer
from producer.completion import Completion
from producer.errors import (Disconnected, EventsLost, InvalidRequest, NotPermitted, ProducerError, QueueFull,
                             UnknownRequest)
from producer.gateway.auth import Tenants, Unauthorized
from producer.gateway.render import (ChatStream, CompletionStream, Heading, ResponseRecord, ResponseStream,
                                     chat_completion, error_body, failure, response_object, text_completion)
from producer.gateway.shapes import (DEFAULT_MAX_TOKENS, ChatCompletionBody, CompletionBody, Refused, ResponsesBody,
                                     chat_request, completion_request, decode, new_id, responses_request,
                                     service_tier)
from producer.protocol import DEFAULT_CLAIM_TTL_S, DEFAULT_REPLAY_TTL_S, TERMINAL, Event, Request

FLEET_REFRESH_S = 1.0  # how stale the ready workers' models may be (/v1/models, /readyz, 503)
RETRY_AFTER_S = 1  # what a 429 asks the client to wait
RECORD_TTL_S = DEFAULT_CLAIM_TTL_S + DEFAULT_REPLAY_TTL_S  # a Responses record outlives its events
CANCEL_WAIT_S = 5.0  # how long POST .../cancel waits for the worker to end the response


@dataclass(frozen=True)
class Settings:
    redis_url: str
    password: str | None = None
    prefix: str = "sb"
    anonymous_tenant: str | None = None  # serves requests without an API key as this tenant
    default_max_tokens: int = DEFAULT_MAX_TOKENS
    queue_timeout: float | None = None  # seconds a request may wait for a worker (then a 504)
    cluster: bool = False  # redis_url names a node of a Redis Cluster


class HTTPFailure(Exception):
    """Ends a request with OpenAI's error JSON."""

    def __init__(self, status: int, message: str, type: str, code: str | None = None, param: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.body, self.headers = status, error_body(message, type, code, param), headers


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter("streambatch:gateway_requests_total", "HTTP requests by endpoint and status",
                                ["endpoint", "status"], registry=self.registry)
        self.open_streams = Gauge("streambatch:gateway_open_streams", "SSE streams open now", registry=self.registry)
        self.event_latency = Histogram("streambatch:gateway_event_latency_seconds",
                                       "time from an event's arrival from Redis to its SSE write",
                                       buckets=(1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 0.1),
                                       registry=self.registry)


class Gateway:
    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.producer = AsyncProducer(settings.redis_url, prefix=settings.prefix, password=settings.password,
                                      cluster=settings.cluster)
        self.tenants = Tenants(self.producer.redis, self.producer.keys, settings.anonymous_tenant)
        self.metrics = Metrics()
        self._producers: dict[tuple[str, int | None], AsyncProducer] = {}
        self._models: tuple[float, list[str]] = (float("-inf"), [])
        self._fleet_read: asyncio.Future | None = None
        self._cancels: set[asyncio.Task] = set()  # cancels of abandoned streams, running on their own

    def producer_of(self, tenant: str) -> AsyncProducer:
        """The tenant's producer, with its backlog limit from the registry (the producer's default
        for a tenant not registered, such as the anonymous one)."""
        entry = self.tenants.registered.get(tenant)
        max_backlog = entry.max_backlog if entry is not None else None
        if (tenant, max_backlog) not in self._producers:
            self._producers[tenant, max_backlog] = self.producer.as_tenant(tenant, max_backlog)
        return self._producers[tenant, max_backlog]

    async def models(self) -> list[str]:
        """The models ready workers serve (from their heartbeats), re-read at most every FLEET_REFRESH_S,
        by one read that every request arriving meanwhile waits for (a burst of requests is one SCAN)."""
        read_at, models = self._models
        if time.monotonic() - read_at <= FLEET_REFRESH_S:
            return models
        if self._fleet_read is None or self._fleet_read.done():
            self._fleet_read = asyncio.ensure_future(self._read_models())
        return await asyncio.shield(self._fleet_read)

    async def _read_models(self) -> list[str]:
        workers = await self.producer.workers()
        models = sorted({worker.model for worker in workers if worker.state == "ready" and worker.model})
        self._models = (time.monotonic(), models)
        return models

    async def served(self, model: str) -> None:
        models = await self.models()
        if not models:
            raise HTTPFailure(503, "no worker is ready: try again shortly", "server_error", "no_ready_worker",
                              headers={"Retry-After": str(RETRY_AFTER_S)})
        if model not in models:
            raise HTTPFailure(404, f"the model {model!r} is not served here (GET /v1/models lists those that are)",
                              "invalid_request_error", "model_not_found", "model")

    async def caller(self, request: HTTPRequest) -> AsyncProducer:
        try:
            return self.producer_of(await self.tenants.tenant_of(request.headers.get("authorization")))
        except Unauthorized as error:
            raise HTTPFailure(401, str(error), "invalid_request_error", "invalid_api_key") from None

    async def submit(self, producer: AsyncProducer, request: Request) -> None:
        if self.settings.queue_timeout is not None:  # not started by then: the worker ends it, a 504
            request = msgspec.structs.replace(request, deadline=time.time() + self.settings.queue_timeout)
        try:
            await producer.submit(request)
        except InvalidRequest as error:
            raise HTTPFailure(400, str(error).removeprefix("invalid request: "), "invalid_request_error") from None
        except QueueFull as error:
            raise HTTPFailure(429, str(error), "rate_limit_error", "queue_full",
                              headers={"Retry-After": str(RETRY_AFTER_S)}) from None

    def abandoned(self, producer: AsyncProducer, request_id: str) -> None:
        """A client left a stream its request lives for: cancel the request, on a task of its own
        (the stream's task is being cancelled itself)."""
        task = asyncio.get_running_loop().create_task(producer.cancel(request_id))
        self._cancels.add(task)
        task.add_done_callback(self._cancels.discard)

    def sse(self, producer: AsyncProducer, request_id: str, render, cancel_if_left: bool,
            done_marker: bool, skip_through: int = -1) -> EventSourceResponse:
        """The request's events rendered as SSE: `render` (a ChatStream, CompletionStream or
        ResponseStream) makes the payloads; Responses events are named by their type and those
        numbered up to `skip_through` are left out (a resumed stream)."""
        metrics = self.metrics

        def message(payload: dict) -> ServerSentEvent:
            event = payload.get("type") if isinstance(render, ResponseStream) else None
            return ServerSentEvent(data=msgspec.json.encode(payload).decode(), event=event)

        def due(payload: dict) -> bool:
            return payload.get("sequence_number", skip_through + 1) > skip_through

        async def events() -> AsyncIterator[ServerSentEvent]:
            metrics.open_streams.inc()
            finished = False
            try:
                for payload in render.opening():
                    if due(payload):
                        yield message(payload)
                async for event in producer.stream(request_id):
                    arrived = time.perf_counter()
                    payloads = [message(payload) for payload in render.push(event) if due(payload)]
                    metrics.event_latency.observe(time.perf_counter() - arrived)
                    for payload in payloads:
                        yield payload
                    finished = isinstance(event, TERMINAL)
                if done_marker:
                    yield ServerSentEvent(data="[DONE]")
            except (EventsLost, UnknownRequest, Disconnected) as error:
                yield message(error_body(str(error), "server_error", "events_lost"))
            finally:
                metrics.open_streams.dec()
                if not finished and cancel_if_left:
                    self.abandoned(producer, request_id)

        return EventSourceResponse(events(), ping=15)


def _endpoint(name: str, handler: Callable[[Gateway, HTTPRequest], Awaitable[Response]]):
    async def endpoint(request: HTTPRequest) -> Response:
        gateway: Gateway = request.app.state.gateway
        try:
            response = await handler(gateway, request)
        except HTTPFailure as failure_:
            response = JSONResponse(failure_.body, failure_.status, headers=failure_.headers)
        except Refused as refused:
            response = JSONResponse(error_body(str(refused), "invalid_request_error", None, refused.param), 400)
        except (redis.ConnectionError, Disconnected) as error:
            response = JSONResponse(error_body(f"Redis is unreachable: {error}", "server_error", "redis_unreachable"),
                                    503, headers={"Retry-After": str(RETRY_AFTER_S)})
        except NotPermitted as error:
            response = JSONResponse(error_body(f"the gateway's Redis user may not do this: {error}", "server_error"),
                                    500)
        except ProducerError as error:  # events lost, or something on Redis that does not decode
            response = JSONResponse(error_body(str(error), "server_error", type(error).__name__), 500)
        gateway.metrics.requests.labels(name, str(response.status_code)).inc()
        return response
    return endpoint


async def _finished(producer: AsyncProducer, request_id: str) -> list[Event]:
    return [event async for event in producer.stream(request_id)]


def _failed(events: list[Event]) -> None:
    """Raise the HTTP failure of a request that ended in one."""
    fault = failure(events[-1])
    if fault is not None:
        raise HTTPFailure(fault.status, fault.message, fault.type, fault.code)


async def _generate(gateway: Gateway, request: HTTPRequest, shape, kind: str, build, stream_type, render,
                    ) -> Response:
    """Chat Completions and Completions alike: `shape` is the body, `build` makes the request,
    `stream_type` renders a stream and `render` the finished completion."""
    producer = await gateway.caller(request)
    body = decode(await request.body(), shape)
    await gateway.served(body.model)
    request_id = new_id(kind)
    work = build(body, request_id)
    heading = Heading(request_id, body.model, int(time.time()), service_tier(work))
    await gateway.submit(producer, work)
    if body.stream:
        usage = body.stream_options is not None and body.stream_options.include_usage
        return gateway.sse(producer, request_id, stream_type(heading, usage), cancel_if_left=True, done_marker=True)
    events = await _finished_or_cancelled(gateway, producer, request, request_id)
    _failed(events)
    return JSONResponse(render(heading, Completion.from_events(request_id, events)))


async def chat_completions(gateway: Gateway, request: HTTPRequest) -> Response:
    def build(body: ChatCompletionBody, request_id: str) -> Request:
        return chat_request(body, request_id, gateway.settings.default_max_tokens)
    return await _generate(gateway, request, ChatCompletionBody, "chatcmpl", build, ChatStream, chat_completion)


async def completions(gateway: Gateway, request: HTTPRequest) -> Response:
    return await _generate(gateway, request, CompletionBody, "cmpl", completion_request, CompletionStream,
                           text_completion)


async def _finished_or_cancelled(gateway: Gateway, producer: AsyncProducer, request: HTTPRequest,
                                 request_id: str) -> list[Event]:
    """The request's events to the end; a client that leaves meanwhile cancels it."""
    waiting = asyncio.ensure_future(_finished(producer, request_id))
    try:
        while True:
            done, _ = await asyncio.wait({waiting}, timeout=0.5)
            if done:
                return waiting.result()
            if await request.is_disconnected():
                waiting.cancel()
                gateway.abandoned(producer, request_id)
                raise HTTPFailure(499, "the client closed the connection", "invalid_request_error")
    except asyncio.CancelledError:
        waiting.cancel()
        gateway.abandoned(producer, request_id)
        raise


async def create_response(gateway: Gateway, request: HTTPRequest) -> Response:
    producer = await gateway.caller(request)
    body = decode(await request.body(), ResponsesBody)
    await gateway.served(body.model)
    response_id = new_id("resp")
    work = responses_request(body, response_id, gateway.settings.default_max_tokens)
    record = ResponseRecord(model=body.model, created_at=int(time.time()), background=body.background,
                            instructions=body.instructions, max_output_tokens=body.max_output_tokens,
                            temperature=body.temperature, top_p=body.top_p,
                            metadata=body.metadata if isinstance(body.metadata, dict) else {},
                            service_tier=service_tier(work))
    await producer.redis.set(producer.keys.response(response_id), msgspec.json.encode(record), ex=RECORD_TTL_S)
    await gateway.submit(producer, work)
    if body.stream:
        return gateway.sse(producer, response_id, ResponseStream(response_id, record),
                                 cancel_if_left=not body.background, done_marker=False)
    if body.background:
        return JSONResponse(response_object(response_id, record, []))
    events = await _finished_or_cancelled(gateway, producer, request, response_id)
    _failed(events)
    return JSONResponse(response_object(response_id, record, events))


async def _record(producer: AsyncProducer, response_id: str) -> ResponseRecord:
    value = await producer.redis.get(producer.keys.response(response_id)) if _plausible(response_id) else None
    if value is None:
        raise HTTPFailure(404, f"no response {response_id!r} (or it has expired)", "invalid_request_error",
                          "not_found", "response_id")
    return msgspec.json.decode(value, type=ResponseRecord)


def _plausible(response_id: str) -> bool:
    return response_id.startswith("resp_") and len(response_id) <= 64 and response_id[5:].isalnum()


async def retrieve_response(gateway: Gateway, request: HTTPRequest) -> Response:
    producer = await gateway.caller(request)
    response_id = request.path_params["response_id"]
    record = await _record(producer, response_id)
    if request.query_params.get("stream") in ("true", "1"):
        try:
            starting_after = int(request.query_params.get("starting_after", "-1"))
        except ValueError:
            raise HTTPFailure(400, "starting_after must be an integer", "invalid_request_error",
                              param="starting_after") from None
        return gateway.sse(producer, response_id, ResponseStream(response_id, record), cancel_if_left=False,
                                 done_marker=False, skip_through=starting_after)
    return JSONResponse(response_object(response_id, record, await _events(producer, response_id)))


async def _events(producer: AsyncProducer, response_id: str) -> list[Event]:
    try:
        return await producer.events(response_id)
    except UnknownRequest:
        return []  # recorded, but its submit has not reached Redis yet


async def cancel_response(gateway: Gateway, request: HTTPRequest) -> Response:
    producer = await gateway.caller(request)
    response_id = request.path_params["response_id"]
    record = await _record(producer, response_id)
    if not record.background:
        raise HTTPFailure(400, "only a background response can be cancelled", "invalid_request_error")
    events = await _events(producer, response_id)
    if not events or not isinstance(events[-1], TERMINAL):
        await producer.cancel(response_id)
        with contextlib.suppress(TimeoutError):
            events = await asyncio.wait_for(_finished(producer, response_id), CANCEL_WAIT_S)
    return JSONResponse(response_object(response_id, record, events or await _events(producer, response_id)))


async def list_models(gateway: Gateway, request: HTTPRequest) -> Response:
    await gateway.caller(request)
    return JSONResponse({"object": "list", "data": [{"id": model, "object": "model", "created": 0,
                                                     "owned_by": "streambatch"} for model in await gateway.models()]})


async def healthz(gateway: Gateway, request: HTTPRequest) -> Response:
    return JSONResponse({"ok": True})


async def readyz(gateway: Gateway, request: HTTPRequest) -> Response:
    try:
        await gateway.producer.redis.ping()
        models = await gateway.models()
    except (redis.RedisError, Disconnected) as error:
        return JSONResponse({"ready": False, "reason": f"Redis is unreachable: {error}"}, 503)
    if not models:
        return JSONResponse({"ready": False, "reason": "no worker is ready"}, 503)
    return JSONResponse({"ready": True, "models": models})


async def metrics(gateway: Gateway, request: HTTPRequest) -> Response:
    return Response(generate_latest(gateway.metrics.registry), media_type=CONTENT_TYPE_LATEST)


def create_app(settings: Settings) -> Starlette:
    gateway = Gateway(settings)

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette):
        yield
        await asyncio.gather(*gateway._cancels, return_exceptions=True)
        await gateway.producer.aclose()

    routes = [Route(path, _endpoint(name, handler), methods=[method]) for path, name, handler, method in (
        ("/v1/chat/completions", "chat.completions", chat_completions, "POST"),
        ("/v1/completions", "completions", completions, "POST"),
        ("/v1/responses", "responses.create", create_response, "POST"),
        ("/v1/responses/{response_id}", "responses.retrieve", retrieve_response, "GET"),
        ("/v1/responses/{response_id}/cancel", "responses.cancel", cancel_response, "POST"),
        ("/v1/models", "models", list_models, "GET"),
        ("/healthz", "healthz", healthz, "GET"),
        ("/readyz", "readyz", readyz, "GET"),
        ("/metrics", "metrics", metrics, "GET"),
    )]
    app = Starlette(routes=routes, lifespan=lifespan)
    app.state.gateway = gateway
    return app
