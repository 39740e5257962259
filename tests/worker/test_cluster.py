"""The service end to end on one Redis node and on a real Redis Cluster (3 masters, 3 replicas),
with the same assertions: the producer library -> Redis -> workers -> replay streams and channels
-> consumers, live and late; greedy tokens equal the offline engine's, every seq exactly once and
in order. On the cluster, the token events of a step go out as one pipeline per node that holds a
running request, never one round trip per request."""

import asyncio
import contextlib
import json
import sys
import threading
import time

import msgspec
import pytest
import redis

from producer import AsyncProducer, Producer
from producer.connect import connect

from ops.demo import free_port
from tests.waiting import wait_for

from .conftest import assert_numbered, backlog, greedy, offline, prompts_of, run_until


@pytest.fixture(params=["node", "cluster"])
def backend(request):
    """-> (the URL, whether it is a cluster), a clean database either way."""
    if request.param == "node":
        return request.getfixturevalue("redis_url"), False
    return request.getfixturevalue("cluster_url"), True


def test_requests_from_sync_and_async_producers_reach_live_and_late_consumers_exactly_once(backend, make_worker,
                                                                                          model):
    url, cluster = backend
    client = connect(url, cluster=cluster)
    workers = [make_worker(name, redis_url=url, redis_cluster=cluster) for name in ("w1", "w2")]
    producer = Producer(url, cluster=cluster)
    prompts = prompts_of(24, seed=5)
    params = [greedy(3 + i % 7) for i in range(24)]
    handles = [producer.submit(prompt_ids=prompt, params=request_params, lane="normal" if i % 2 else None)
               for i, (prompt, request_params) in enumerate(zip(prompts[:16], params[:16]))]
    assert {handle.lane for handle in handles} == {"fast", "normal"}
    streamed: dict[str, list] = {}
    live = [threading.Thread(target=lambda h=handle: streamed.__setitem__(h.id, list(h.stream(timeout=60))))
            for handle in handles[:8]]
    for thread in live:
        thread.start()

    async def through_the_async_producer():
        async with AsyncProducer(url, cluster=cluster) as async_producer:
            submitted = [await async_producer.submit(prompt_ids=prompt, params=request_params)
                         for prompt, request_params in zip(prompts[16:], params[16:])]
            return [handle.id for handle in submitted], await asyncio.gather(
                *(collect(async_producer, handle.id) for handle in submitted))

    async_outcome = []
    following = threading.Thread(target=lambda: async_outcome.append(asyncio.run(through_the_async_producer())))
    following.start()
    run_until(workers, lambda: not following.is_alive() and backlog(client) == 0
              and not any(thread.is_alive() for thread in live), timeout=120)

    expected = offline(model, prompts, params)
    for i, handle in enumerate(handles):
        result = handle.result(timeout=10)  # for the later half, a consumer arriving after the end
        assert (result.token_ids, result.finish_reason) == (expected[i], "length"), handle.id
    for handle in handles[:8]:
        events = streamed[handle.id]
        assert_numbered(events)
        assert [token for event in events[:-1] for token in event.ids] == expected[handles.index(handle)]
    [(ids, events_of)] = async_outcome
    for i, (request_id, events) in enumerate(zip(ids, events_of)):
        assert_numbered(events)
        assert [token for event in events[:-1] for token in event.ids] == expected[16 + i], request_id
    producer.close()


async def collect(producer: AsyncProducer, request_id: str) -> list:
    return [event async for event in producer.stream(request_id, timeout=60)]


def test_a_steps_events_go_out_as_one_pipeline_per_node_that_holds_a_running_request(cluster_url, redis_cluster,
                                                                                     make_worker):
    """Counted on the wire: each master's EVALSHA calls, and the worker's pipelines and the nodes
    each one reached, over steps where 24 requests run spread over the three masters."""
    worker = make_worker(redis_url=cluster_url, redis_cluster=True, intake_ahead=64)
    producer = Producer(cluster_url, cluster=True)
    for prompt in prompts_of(24, seed=9):
        producer.submit(prompt_ids=prompt, params=greedy(12))
    run_until([worker], lambda: len(worker.flights) == 24 and all(
        flight.sequence is not None and flight.sequence.num_output_tokens > 0 for flight in worker.flights.values()))
    owners = {worker.client.get_node_from_key(flight.keys.replay(flight.request_id)).name
              for flight in worker.flights.values()}
    assert len(owners) == 3, "the requests' keys span the three masters"
    nodes = {node.name: redis.Redis(host=node.host, port=node.port) for node in worker.client.get_primaries()}

    def scripts_run() -> dict[str, int]:
        return {name: client.info("commandstats").get("cmdstat_evalsha", {}).get("calls", 0)
                for name, client in nodes.items()}

    sent = []  # the worker's writes on the wire: one per round trip, by the node's address
    send = redis.connection.Connection.send_packed_command

    def counted(connection, command, *args, **kwargs):
        sent.append(f"{connection.host}:{connection.port}")
        return send(connection, command, *args, **kwargs)

    worker.step()
    before = scripts_run()
    redis.connection.Connection.send_packed_command = counted
    try:
        worker.publish()
    finally:
        redis.connection.Connection.send_packed_command = send
    after = scripts_run()
    assert sum(after.values()) - sum(before.values()) == 24, "one fenced script per request"
    assert {name for name in nodes if after[name] > before[name]} == owners
    assert sorted(sent) == sorted(owners), "one round trip to each node holding a running request"
    asked = sum(client.info("commandstats").get("cmdstat_command|getkeys", {}).get("calls", 0)
                for client in nodes.values())
    assert asked == 0, "the client asked a server where the keys of a command are (a round trip each)"
    producer.close()


def models(client) -> list:
    """The models a gateway lists, or none while it does not answer yet."""
    import openai

    try:
        return client.models.list().data
    except openai.APIError:
        return []


@contextlib.contextmanager
def serving(worker):
    """The worker's loop on a thread until the block ends (its clients are used there only)."""
    stop = threading.Event()

    def loop():
        while not stop.is_set():
            worker.turn()

    thread = threading.Thread(target=loop, daemon=True)
    thread.start()
    try:
        yield worker
    finally:
        stop.set()
        thread.join(timeout=30)


def test_only_an_idle_worker_follows_the_enqueue_nudges_and_one_wakes_it(cluster_url, make_worker):
    """On a cluster no read blocks, so an idle worker waits for a producer's nudge (SPUBLISH in the
    stream's slot): it is subscribed while idle, woken well before its wait's end by a submit, and
    unsubscribed as soon as it has work, so a busy fleet is sent no nudges."""
    worker = make_worker(redis_url=cluster_url, redis_cluster=True)
    channel = worker.keys.enqueued("normal")
    node = worker.client.get_redis_connection(worker.client.get_node_from_key(channel))

    def followers() -> int:
        _, count = node.execute_command("PUBSUB", "SHARDNUMSUB", channel)
        return count

    read: list = []
    waiting = threading.Thread(target=lambda: read.extend(worker.intake.read(4, block_ms=60_000)))
    waiting.start()
    wait_for(lambda: followers() == 1, 10, "the idle worker follows its streams' nudges")
    Producer(cluster_url, cluster=True).submit(prompt_ids=[5, 6], params=greedy(2), lane="normal")
    waiting.join(timeout=20)
    assert not waiting.is_alive() and len(read) == 1, "the nudge woke the worker (its wait was a minute)"
    assert worker.intake.read(4, block_ms=None) == [] and followers() == 0, "a busy worker follows nothing"


def test_the_cli_the_gateway_and_rq_jobs_on_the_cluster(cluster_url, redis_url, model_dir, tmp_path, capsys,
                                                          monkeypatch, launch):
    """Every entry point with --redis-cluster (or $STREAMBATCH_REDIS_CLUSTER) against one worker on the
    cluster; each answer is the offline engine's."""
    from rq import Queue, SimpleWorker
    from rq.serializers import JSONSerializer

    import openai

    from producer import rq_jobs
    from producer.cli import main
    from producer.protocol import SamplingParams
    from worker.config import WorkerConfig
    from worker.engine.config import EngineConfig
    from worker.llm import LLM
    from worker.service import Worker

    greedy8 = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    offline = LLM(str(model_dir), num_blocks=64)
    config = WorkerConfig(engine=EngineConfig.from_options(str(model_dir), num_blocks=64), redis_url=cluster_url,
                          redis_cluster=True, name="cw", heartbeat_interval=0.2, reclaim_idle_ms=60_000)
    worker = Worker(config)
    try:
        with serving(worker):
            cli = ["--redis-url", cluster_url, "--redis-cluster"]
            assert main([*cli, "submit", "The sky is", "--max-tokens", "8", "--temperature", "0", "--id", "by-cli"]) == 0
            assert main([*cli, "result", "by-cli", "--json", "--timeout", "60"]) == 0
            answer = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
            assert answer["token_ids"] == offline.generate("The sky is", SamplingParams(max_tokens=8, temperature=0),
                                                           progress=False)[0].token_ids
            assert main(["--redis-url", cluster_url, "--redis-cluster", "stats", "--json"]) == 0
            assert '"cw"' in capsys.readouterr().out  # the workers, by a SCAN of every node

            port = free_port()
            gateway = launch([sys.executable, "-m", "producer.gateway", "--redis-url", cluster_url, "--redis-cluster",
                              "--port", str(port), "--anonymous-tenant", "default", "--log-level", "warning"],
                             tmp_path / "gateway.log")
            client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0)
            wait_for(lambda: models(client), 60, f"the gateway on the cluster ({gateway.poll()})")
            question = [{"role": "user", "content": "Name three colours."}]
            chunks = client.chat.completions.create(model=str(model_dir), messages=question, max_tokens=8,
                                                    temperature=0, stream=True, extra_body={"ignore_eos": True})
            streamed = "".join(chunk.choices[0].delta.content or "" for chunk in chunks if chunk.choices)
            assert streamed == offline.generate(question, greedy8, progress=False)[0].text

            monkeypatch.setenv("STREAMBATCH_REDIS_CLUSTER", "1")  # what streambatch-rq-worker --redis-cluster sets
            queue = Queue("llm", connection=redis.Redis.from_url(redis_url), serializer=JSONSerializer)
            job = queue.enqueue(rq_jobs.generate, "The sea is", params=msgspec.structs.asdict(greedy8),
                                url=cluster_url)
            SimpleWorker([queue], connection=queue.connection, serializer=JSONSerializer).work(burst=True)
            assert job.latest_result().return_value["text"] == offline.generate("The sea is", greedy8,
                                                                                progress=False)[0].text
    finally:
        worker.close()


def test_a_tenant_resharded_up_and_down_while_its_requests_are_in_flight_loses_none(cluster_url, make_worker, model,
                                                                                    monkeypatch):
    """A registered tenant (its ACL user on every node) from 1 shard per lane to 4 and back to 2 while
    its requests run: each reshard is picked up by producers and the worker, and a producer still
    sending to a shard past the new count (its count not yet read again) is served all the same."""
    from producer import core as producer_core
    from producer.core import shard_of
    from producer.protocol import LANES, Keys, TenantSettings
    from producer.tenants import TenantRegistry

    monkeypatch.setattr(producer_core, "SETTINGS_REFRESH_S", 0.1)
    operator = connect(cluster_url, cluster=True)
    registry = TenantRegistry(operator, Keys())
    password = registry.add("team").password
    keys = Keys().of("team")
    tenant_url = cluster_url.replace("redis://", "redis://tenant-team@")
    producer = Producer(tenant_url, password=password, tenant="team", cluster=True)
    stale = Producer(tenant_url, password=password, tenant="team", cluster=True)
    worker = make_worker(redis_url=cluster_url, redis_cluster=True, heartbeat_interval=0.1)
    prompts = prompts_of(40, seed=11)
    params = [greedy(20 + i % 13) for i in range(40)]
    handles = []

    def submit(indices) -> None:
        for i in indices:
            handles.append(producer.submit(prompt_ids=prompts[i], params=params[i], request_id=f"t{i}"))
        run_until([worker], lambda: any(flight.sequence is not None for flight in worker.flights.values()))

    def shards_used() -> set[int]:
        return {shard for lane in LANES for shard in range(4) if operator.exists(keys.requests(lane, shard))
                and operator.xinfo_stream(keys.requests(lane, shard))["entries-added"]}

    submit(range(10))
    assert shards_used() == {0}
    registry.reshard("team", 4)
    time.sleep(0.2)  # past SETTINGS_REFRESH_S: the producer reads the new count at its next submit
    submit(range(10, 25))
    # read before the reshard down, and kept a while
    stale.core.tenant_settings = (time.monotonic() + 60, TenantSettings(shards=4))
    registry.reshard("team", 2)
    time.sleep(0.2)
    submit(range(25, 37))
    for i in range(37, 39):
        handles.append(producer.submit(prompt_ids=prompts[i], params=params[i], request_id=f"t{i}"))
    late = next(name for name in (f"late{k}" for k in range(100)) if shard_of(name, 4) == 3)
    handles.append(stale.submit(prompt_ids=prompts[39], params=params[39], request_id=late))
    assert handles[-1].lane is not None and any(
        late.encode() in fields[b"m"] for lane in LANES for _, fields in operator.xrange(keys.requests(lane, 3)))
    assert shards_used() == {0, 1, 2, 3}
    run_until([worker], lambda: all(finished(handle) for handle in handles), timeout=120)
    expected = offline(model, prompts, params)
    for i, handle in enumerate(handles):
        assert handle.result(timeout=5).token_ids == expected[i], handle.id
    producer.close()
    stale.close()


def finished(handle) -> bool:
    try:
        handle.result(timeout=0.01)
    except TimeoutError:
        return False
    return True
