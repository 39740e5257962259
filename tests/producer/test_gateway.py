"""The OpenAI gateway (producer/gateway/) as a user runs it: a real redis-server, a real worker
process on a tiny random model with the SmolLM2 tokenizer (a model directory like any other), the
gateway under uvicorn, all on loopback, driven by the official openai package, sync and async."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import urllib.error
import msgspec
import openai
import pytest
import redis

from producer.protocol import DoneEvent, Keys, SamplingParams, decode_event, FIELD
from producer.tenants import TenantRegistry
from worker.heartbeat import worker_of
from tests.conftest import private_redis
from tests.waiting import START_TIMEOUT_S, wait_for

ROOT = Path(__file__).resolve().parents[2]
TENANT = "team-a"
KEYS = Keys()
QUESTION = [{"role": "user", "content": "Name three colours."}]
UNREACHABLE = (OSError, openai.APIError, redis.RedisError)  # a process not serving yet


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


class Processes:
    """Processes started from the repository root, each logging to a file; all killed at the end."""

    def __init__(self, logs: Path) -> None:
        self.logs, self.running = logs, []

    def start(self, name: str, *argv: str) -> subprocess.Popen:
        log = open(self.logs / f"{name}.log", "ab")
        process = subprocess.Popen([sys.executable, "-m", *argv], cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
                                   env=os.environ | {"PYTHONUNBUFFERED": "1"})
        self.running.append(process)
        return process

    def log(self, name: str) -> str:
        return (self.logs / f"{name}.log").read_text(errors="replace")

    def stop_all(self) -> None:
        for process in self.running:
            if process.poll() is None:
                process.kill()
                process.wait()


def http_get(url: str) -> tuple[int, dict]:
    """-> (status, JSON body) of a plain GET, whatever the status."""
    try:
        with urllib.request.urlopen(url, timeout=5) as reply:
            return reply.status, json.load(reply)
    except urllib.error.HTTPError as error:
        return error.code, json.load(error)


class Stack:
    def __init__(self, processes: Processes, redis_url: str, model_dir: Path) -> None:
        self.processes, self.redis_url, self.model_dir = processes, redis_url, model_dir
        self.client = redis.Redis.from_url(redis_url)
        self.workers: dict[str, subprocess.Popen] = {}
        self.worker_metrics: dict[str, int] = {}

    def worker(self, *extra: str) -> subprocess.Popen:
        name, port = f"w{len(self.workers) + 1}", free_port()
        process = self.workers[name] = self.processes.start(name, "worker", "--model", str(self.model_dir), "--redis-url", self.redis_url,
                                       "--name", name, "--heartbeat-interval", "0.5", "--reclaim-idle-ms", "1500",
                                       "--metrics-port", str(port), "--log-level", "warning", *extra)
        self.worker_metrics[name] = port
        wait_for(lambda: urllib.request.urlopen(f"http://127.0.0.1:{port}/readyz", timeout=2).status == 200, START_TIMEOUT_S,
                 f"worker {name} ready", UNREACHABLE)
        return process

    def gateway(self, name: str, *extra: str) -> tuple[subprocess.Popen, str]:
        port = free_port()
        process = self.processes.start(name, "producer.gateway", "--redis-url", self.redis_url, "--port", str(port),
                                       "--log-level", "warning", *extra)
        base = f"http://127.0.0.1:{port}"
        wait_for(lambda: http_get(f"{base}/healthz")[0] == 200, START_TIMEOUT_S, f"gateway {name} up", UNREACHABLE)
        return process, base + "/v1"


@pytest.fixture(scope="module")
def stack(tmp_path_factory, model_dir):
    processes = Processes(tmp_path_factory.mktemp("logs"))
    with private_redis(tmp_path_factory.mktemp("redis")) as (url, _):
        stack = Stack(processes, url, model_dir)
        try:
            stack.worker()
            stack.api_key = TenantRegistry(stack.client, KEYS).add(TENANT).api_key
            stack.gateway_process, stack.base_url = stack.gateway("gateway")
            client = openai.OpenAI(base_url=stack.base_url, api_key=stack.api_key)
            wait_for(lambda: client.models.list().data, 30, "a model listed", UNREACHABLE)
            yield stack
        finally:
            processes.stop_all()


@pytest.fixture(scope="module")
def offline(model_dir):
    from worker.llm import LLM

    llm = LLM(str(model_dir), num_blocks=256)
    return lambda messages, params: llm.generate(messages, params, progress=False)[0]


@pytest.fixture
def client(stack):
    return openai.OpenAI(base_url=stack.base_url, api_key=stack.api_key, max_retries=0)


def test_models_lists_what_ready_workers_serve(client, model_dir):
    assert [model.id for model in client.models.list().data] == [str(model_dir)]


def test_chat_streamed_deltas_are_the_completion_and_the_offline_engines_text(client, offline, model_dir):
    model = str(model_dir)
    plain = client.chat.completions.create(model=model, messages=QUESTION, max_tokens=12, temperature=0)
    chunks = list(client.chat.completions.create(model=model, messages=QUESTION, max_tokens=12, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    streamed = "".join(chunk.choices[0].delta.content or "" for chunk in chunks if chunk.choices)
    expected = offline(QUESTION, SamplingParams(max_tokens=12, temperature=0))
    assert plain.choices[0].message.content == streamed == expected.text
    assert plain.choices[0].finish_reason == "length" and chunks[-2].choices[0].finish_reason == "length"
    assert chunks[0].choices[0].delta.role == "assistant"
    usage = chunks[-1].usage
    assert (usage.prompt_tokens, usage.completion_tokens) == (expected.usage.prompt_tokens, 12)
    assert (plain.usage.prompt_tokens, plain.usage.completion_tokens, plain.usage.total_tokens) == \
        (expected.usage.prompt_tokens, 12, expected.usage.prompt_tokens + 12)


def test_completions_with_text_and_token_ids_streamed_or_not(client, offline, model_dir):
    model = str(model_dir)
    text = client.completions.create(model=model, prompt="The sky is", max_tokens=8, temperature=0)
    chunks = list(client.completions.create(model=model, prompt="The sky is", max_tokens=8, temperature=0,
                                            stream=True))
    assert text.choices[0].text == "".join(chunk.choices[0].text for chunk in chunks)
    assert text.choices[0].text == offline("The sky is", SamplingParams(max_tokens=8, temperature=0)).text
    ids = client.completions.create(model=model, prompt=[5, 6, 7, 8], max_tokens=4, temperature=0)
    assert ids.usage.prompt_tokens == 4 and ids.usage.completion_tokens == 4
    assert ids.choices[0].finish_reason == "length"


def test_logprobs_and_stop_strings(client, offline, model_dir):
    model = str(model_dir)
    with_logprobs = client.chat.completions.create(model=model, messages=QUESTION, max_tokens=6, temperature=0,
                                                   logprobs=True, top_logprobs=3)
    content = with_logprobs.choices[0].logprobs.content
    assert len(content) == 6 and all(len(entry.top_logprobs) == 3 for entry in content)
    assert all(entry.logprob <= 0 and entry.top_logprobs[0].logprob >= entry.top_logprobs[-1].logprob
               for entry in content)
    legacy = client.completions.create(model=model, prompt=[5, 6, 7], max_tokens=3, temperature=0, logprobs=2)
    assert len(legacy.choices[0].logprobs.tokens) == 3 and all(len(top) <= 2 for top in
                                                              legacy.choices[0].logprobs.top_logprobs)
    full = offline(QUESTION, SamplingParams(max_tokens=24, temperature=0)).text
    stop = full[len(full) // 2:len(full) // 2 + 3]
    stopped = client.chat.completions.create(model=model, messages=QUESTION, max_tokens=24, temperature=0, stop=[stop])
    assert stopped.choices[0].finish_reason == "stop" and stop not in stopped.choices[0].message.content
    assert full.startswith(stopped.choices[0].message.content)


def test_responses_create_stream_and_retrieve(client, offline, model_dir):
    model = str(model_dir)
    expected = offline([{"role": "system", "content": "Be brief."}] + QUESTION,
                       SamplingParams(max_tokens=10, temperature=0)).text
    plain = client.responses.create(model=model, input="Name three colours.", instructions="Be brief.",
                                    max_output_tokens=10, temperature=0)
    assert plain.status == "incomplete" and plain.output_text == expected
    assert plain.incomplete_details.reason == "max_output_tokens" and plain.usage.output_tokens == 10
    events = list(client.responses.create(model=model, input="Name three colours.", instructions="Be brief.",
                                          max_output_tokens=10, temperature=0, stream=True))
    assert [event.sequence_number for event in events] == list(range(len(events)))
    assert events[0].type == "response.created" and events[-1].type == "response.incomplete"
    assert "".join(event.delta for event in events if event.type == "response.output_text.delta") == expected
    again = client.responses.retrieve(events[0].response.id)
    assert again.status == "incomplete" and again.output_text == expected


def test_service_tier_is_the_lane_hint_and_each_answer_names_its_lane(stack, client, model_dir):
    """"priority" asks for the fast lane, which the lane rule grants only a short request; "flex"
    sends even a short one to the normal lane; each answer names the lane its request went to."""
    model, keys = str(model_dir), KEYS.of(TENANT)

    def asked(tier: str | None, max_tokens: int) -> tuple[str, str]:
        before = {lane: stack.client.xinfo_stream(keys.requests(lane))["last-generated-id"]
                  for lane in ("fast", "normal")}
        answer = client.chat.completions.create(model=model, messages=QUESTION, max_tokens=max_tokens, temperature=0,
                                                **({"service_tier": tier} if tier else {}))
        grown = [lane for lane in ("fast", "normal")
                 if stack.client.xinfo_stream(keys.requests(lane))["last-generated-id"] != before[lane]]
        return answer.service_tier, grown[0]

    assert asked("priority", 4) == ("priority", "fast")
    assert asked("flex", 4) == ("flex", "normal")
    assert asked(None, 4) == ("priority", "fast")  # the rule's own choice for a short request
    assert asked("priority", 400) == ("default", "normal")  # too long for the fast lane: demoted
    streamed = list(client.chat.completions.create(model=model, messages=QUESTION, max_tokens=2, stream=True,
                                                   service_tier="flex"))
    assert {chunk.service_tier for chunk in streamed} == {"flex"}
    response = client.responses.create(model=model, input="Hi", max_output_tokens=2, service_tier="priority")
    assert response.service_tier == "priority"
    assert client.responses.retrieve(response.id).service_tier == "priority"
    with pytest.raises(openai.BadRequestError) as bad:
        client.chat.completions.create(model=model, messages=QUESTION, max_tokens=2, service_tier="scale")
    assert bad.value.body["param"] == "service_tier"


def test_errors_come_in_openais_shape(stack, client, model_dir):
    model = str(model_dir)
    anonymous = openai.OpenAI(base_url=stack.base_url, api_key="not-a-key", max_retries=0)
    with pytest.raises(openai.AuthenticationError) as refused:
        anonymous.models.list()
    assert refused.value.body["message"] == "invalid API key" and refused.value.body["code"] == "invalid_api_key"
    status, body = http_get(stack.base_url + "/models")
    assert status == 401 and set(body["error"]) == {"message", "type", "param", "code"}
    cases = [
        (dict(n=2), "n"), (dict(tools=[{"type": "function", "function": {"name": "f"}}]), "tools"),
        (dict(extra_body={"no_such_field": 1}), "no_such_field"), (dict(temperature=-1), "temperature"),
    ]
    for options, param in cases:
        with pytest.raises(openai.BadRequestError) as bad:
            client.chat.completions.create(model=model, messages=QUESTION, max_tokens=2, **options)
        assert bad.value.body["param"] == param and bad.value.body["type"] == "invalid_request_error", options
    with pytest.raises(openai.NotFoundError) as unknown_model:
        client.chat.completions.create(model="gpt-9", messages=QUESTION, max_tokens=2)
    assert unknown_model.value.body["code"] == "model_not_found"
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve("resp_0123456789abcdef")
    with pytest.raises(openai.BadRequestError) as too_long:
        client.chat.completions.create(model=model, messages=[{"role": "user", "content": "word " * 5000}],
                                       max_tokens=2)
    assert too_long.value.body["code"] == "context_length_exceeded"


def worker_counter(stack: Stack, name: str, metric: str) -> float:
    with urllib.request.urlopen(f"http://127.0.0.1:{stack.worker_metrics[name]}/metrics", timeout=5) as reply:
        lines = reply.read().decode().splitlines()
    return sum(float(line.rsplit(" ", 1)[1]) for line in lines if line.startswith(metric))


def test_a_client_that_leaves_a_stream_cancels_its_request(stack, client, model_dir):
    cancelled = 'streambatch:request_success_total{finished_reason="cancelled"}'
    before = worker_counter(stack, "w1", cancelled)
    stream = client.chat.completions.create(model=str(model_dir), messages=QUESTION, max_tokens=400, temperature=0,
                                            stream=True)
    request_id = None
    for index, chunk in enumerate(stream):
        request_id = chunk.id
        if index == 3:
            break
    stream.close()
    keys = KEYS.of(TENANT)
    wait_for(lambda: worker_counter(stack, "w1", cancelled) == before + 1, 10, "the worker's cancelled counter", UNREACHABLE)
    done = decode_event(stack.client.xrange(keys.replay(request_id))[-1][1][FIELD])
    assert isinstance(done, DoneEvent) and done.finish_reason == "cancelled" and done.usage.completion_tokens < 400


def test_the_async_client_streams_and_background_responses_run_without_a_connection(stack, model_dir, offline):
    async def run():
        client = openai.AsyncOpenAI(base_url=stack.base_url, api_key=stack.api_key, max_retries=0)
        chunks = [chunk async for chunk in await client.chat.completions.create(
            model=str(model_dir), messages=QUESTION, max_tokens=8, temperature=0, stream=True)]
        queued = await client.responses.create(model=str(model_dir), input="Name three colours.",
                                               max_output_tokens=8, temperature=0, background=True)
        while (found := await client.responses.retrieve(queued.id)).status in ("queued", "in_progress"):
            await asyncio.sleep(0.1)
        await client.close()
        return chunks, queued, found

    chunks, queued, found = asyncio.run(run())
    expected = offline(QUESTION, SamplingParams(max_tokens=8, temperature=0)).text
    assert "".join(chunk.choices[0].delta.content or "" for chunk in chunks) == expected
    assert queued.status == "queued" and queued.background
    assert found.status == "incomplete" and found.output_text == expected


def holder(stack: Stack, keys: Keys, request_id: str) -> str | None:
    """The name of the worker whose consumer holds the request's entry, if one does."""
    for lane in ("fast", "normal"):
        stream = keys.requests(lane)
        entries = {entry_id: fields for entry_id, fields in stack.client.xrange(stream)}
        for pending in stack.client.xpending_range(stream, "workers", "-", "+", 100):
            fields = entries.get(pending["message_id"])
            if fields and msgspec.msgpack.decode(fields[FIELD]).get("id") == request_id:
                return worker_of(pending["consumer"].decode())
    return None


@pytest.mark.long
def test_a_background_stream_resumes_on_another_gateway_after_sigkill_and_a_worker_kill(stack, model_dir, offline):
    """Read to sequence number N, SIGKILL that gateway, kill -9 the worker mid-generation, then
    `starting_after=N` on a second gateway: every later event once, none missing, and the text of
    an undisturbed run."""
    stack.worker()  # the one left when the other is killed
    first, first_url = stack.gateway("gateway-a")
    client = openai.OpenAI(base_url=first_url, api_key=stack.api_key, max_retries=0)
    question = [{"role": "user", "content": "Tell me a long story."}]
    params = dict(model=str(model_dir), input=question[0]["content"], max_output_tokens=300, temperature=0)
    stream = client.responses.create(**params, stream=True, background=True)
    seen = []
    for event in stream:
        seen.append(event)
        if len(seen) == 8:
            break
    first.send_signal(signal.SIGKILL)
    first.wait()
    response_id, keys = seen[0].response.id, KEYS.of(TENANT)
    name = holder(stack, keys, response_id)
    assert name is not None, "the response finished before its worker could be killed"
    stack.workers[name].send_signal(signal.SIGKILL)
    stack.workers[name].wait()
    _, second_url = stack.gateway("gateway-b")
    resumed = list(openai.OpenAI(base_url=second_url, api_key=stack.api_key, max_retries=0).responses.retrieve(
        response_id, stream=True, starting_after=seen[-1].sequence_number))
    numbers = [event.sequence_number for event in seen + resumed]
    assert numbers == list(range(len(numbers)))
    text = "".join(event.delta for event in seen + resumed if event.type == "response.output_text.delta")
    assert text == offline(question, SamplingParams(max_tokens=300, temperature=0)).text
    assert resumed[-1].type == "response.incomplete"
    attempts = {decode_event(fields[FIELD]).attempt for _, fields in stack.client.xrange(keys.replay(response_id))}
    assert attempts == {1, 2}, "the request was resumed by the other worker"


def test_no_ready_worker_a_full_queue_and_a_passed_deadline(stack, model_dir):
    """On a prefix of its own: first no worker (503), then one that only looks ready and a backlog at
    the tenant's registry limit (429), then a request that waits past --queue-timeout for the
    worker that comes at last (504)."""
    other = Keys("other")
    api_key = TenantRegistry(stack.client, other).add(TENANT, max_backlog=1).api_key
    _, url = stack.gateway("gateway-other", "--prefix", "other", "--queue-timeout", "1")
    client = openai.OpenAI(base_url=url, api_key=api_key, max_retries=0)
    ask = dict(model=str(model_dir), messages=QUESTION, max_tokens=4)
    with pytest.raises(openai.InternalServerError) as none_ready:
        client.chat.completions.create(**ask)
    assert none_ready.value.status_code == 503 and none_ready.value.body["code"] == "no_ready_worker"
    assert http_get(url.removesuffix("/v1") + "/readyz") == (503, {"ready": False, "reason": "no worker is ready"})

    looks_ready = {"name": "fake", "model": str(model_dir), "state": "ready"}
    stack.client.set(other.worker("fake"), json.dumps(looks_ready), ex=60)
    for lane in ("fast", "normal"):
        stack.client.xadd(other.of(TENANT).requests(lane), {FIELD: b"waiting"})
    wait_for(lambda: http_get(url.removesuffix("/v1") + "/readyz")[0] == 200, 10, "the gateway sees a ready worker", UNREACHABLE)
    with pytest.raises(openai.RateLimitError) as full:
        client.chat.completions.create(**ask)
    assert full.value.response.headers["retry-after"] == "1" and full.value.body["code"] == "queue_full"

    for lane in ("fast", "normal"):
        stack.client.delete(other.of(TENANT).requests(lane))
    outcome = {}

    def waits():
        try:
            client.chat.completions.create(**ask)
        except openai.APIStatusError as error:
            outcome["error"] = error

    waiting = threading.Thread(target=waits)
    waiting.start()
    time.sleep(1.5)
    stack.worker("--prefix", "other")
    waiting.join(60)
    assert outcome["error"].status_code == 504 and outcome["error"].body["code"] == "deadline"


def test_metrics_count_requests_and_events(stack, client, model_dir):
    client.chat.completions.create(model=str(model_dir), messages=QUESTION, max_tokens=3, stream=True).close()
    with urllib.request.urlopen(stack.base_url.removesuffix("/v1") + "/metrics", timeout=5) as reply:
        text = reply.read().decode()
    assert 'streambatch:gateway_requests_total{endpoint="chat.completions",status="200"}' in text
    assert "streambatch:gateway_event_latency_seconds_count" in text and "streambatch:gateway_open_streams" in text


def test_the_gateway_role_serves_every_tenant_and_is_refused_the_rest(tmp_path, model_dir):
    """The gateway as the `gateway` ACL user, the worker as `worker`, on a redis-server loaded with
    the ACL file: two tenants' keys served, and what the role must not do refused."""
    from producer.acl import GATEWAY_USER, OPERATOR_USER, WORKER_USER, users_acl

    passwords = {GATEWAY_USER: "gateway-secret", WORKER_USER: "worker-secret", OPERATOR_USER: "operator-secret"}
    (tmp_path / "users.acl").write_text(users_acl(KEYS, {user: f">{secret}" for user, secret in passwords.items()}))
    for user, secret in passwords.items():
        (tmp_path / f"{user}.password").write_text(secret + "\n")
    processes = Processes(tmp_path)
    with private_redis(tmp_path, passwords[OPERATOR_USER], username=OPERATOR_USER,
                       options=("--aclfile", str(tmp_path / "users.acl"))) as (url, _):
        host = url.removeprefix("redis://")
        operator = redis.Redis.from_url(url, username=OPERATOR_USER, password=passwords[OPERATOR_USER])
        keys = {tenant: TenantRegistry(operator, KEYS).add(tenant).api_key for tenant in ("team-a", "team-b")}
        stack = Stack(processes, f"redis://{WORKER_USER}@{host}", model_dir)
        try:
            stack.worker("--redis-password-file", str(tmp_path / "worker.password"))
            stack.redis_url = f"redis://{GATEWAY_USER}@{host}"
            _, base_url = stack.gateway("gateway", "--redis-password-file", str(tmp_path / "gateway.password"))
            for tenant, api_key in keys.items():
                client = openai.OpenAI(base_url=base_url, api_key=api_key, max_retries=0)
                wait_for(lambda: client.models.list().data, 30, "a model listed", UNREACHABLE)
                reply = client.chat.completions.create(model=str(model_dir), messages=QUESTION, max_tokens=4)
                assert reply.usage.completion_tokens == 4
                assert operator.exists(KEYS.of(tenant).replay(reply.id))
                queued = client.responses.create(model=str(model_dir), input="Hi", max_output_tokens=4,
                                                 background=True)
                wait_for(lambda: client.responses.retrieve(queued.id).status == "incomplete", 30, "a response done", UNREACHABLE)
        finally:
            processes.stop_all()
        gateway = redis.Redis.from_url(url, username=GATEWAY_USER, password=passwords[GATEWAY_USER])
        team_a = KEYS.of("team-a")
        attempts = {
            "write the registry": lambda: gateway.hset(KEYS.tenants, "team-c", b"{}"),
            "forge an event": lambda: gateway.xadd(team_a.replay("any"), {FIELD: b"x"}),
            "take work as a worker": lambda: gateway.xreadgroup("workers", "me", {team_a.requests("normal"): ">"}),
            "DEL a lane stream": lambda: gateway.delete(team_a.requests("normal")),
            "write a heartbeat": lambda: gateway.set(KEYS.worker("fake"), b"{}"),
            "read the dead letters": lambda: gateway.xrange(KEYS.dead_letters),
            "read the pins": lambda: gateway.hgetall(KEYS.pins),
            "FLUSHALL": gateway.flushall, "CONFIG": lambda: gateway.config_get("*"), "KEYS": lambda: gateway.keys("*"),
            "EVAL": lambda: gateway.eval("return 1", 0),
            "ACL SETUSER": lambda: gateway.execute_command("ACL", "SETUSER", "mine", "on"),
        }
        allowed = []
        for what, attempt in attempts.items():
            try:
                attempt()
                allowed.append(what)
            except redis.exceptions.NoPermissionError:
                pass
        assert allowed == []


@pytest.mark.real_model
@pytest.mark.long
def test_the_bundled_model_answers_through_the_gateway_as_offline(tmp_path):
    from worker.llm import LLM

    processes = Processes(tmp_path)
    with private_redis(tmp_path) as (url, _):
        stack = Stack(processes, url, Path("smollm2-135m"))
        try:
            stack.worker()
            _, base_url = stack.gateway("gateway", "--anonymous-tenant", "default")
            client = openai.OpenAI(base_url=base_url, api_key="none", max_retries=0)
            wait_for(lambda: client.models.list().data, 30, "a model listed", UNREACHABLE)
            streamed = "".join(chunk.choices[0].delta.content or "" for chunk in client.chat.completions.create(
                model="smollm2-135m", messages=QUESTION, max_tokens=24, temperature=0, stream=True))
        finally:
            processes.stop_all()
    expected = LLM("smollm2-135m").generate(QUESTION, SamplingParams(max_tokens=24, temperature=0), progress=False)
    assert streamed == expected[0].text and streamed


def test_a_background_response_is_cancelled_and_a_plain_one_cannot_be(client, model_dir):
    running = client.responses.create(model=str(model_dir), input="Tell me a long story.", max_output_tokens=900,
                                      temperature=0, background=True)
    wait_for(lambda: client.responses.retrieve(running.id).status == "in_progress", 30, "the response started", UNREACHABLE)
    cancelled = client.responses.cancel(running.id)
    assert cancelled.status == "cancelled" and client.responses.retrieve(running.id).status == "cancelled"
    assert 0 < len(cancelled.output_text) and cancelled.usage.output_tokens < 900
    plain = client.responses.create(model=str(model_dir), input="Hi", max_output_tokens=2)
    with pytest.raises(openai.BadRequestError):
        client.responses.cancel(plain.id)
