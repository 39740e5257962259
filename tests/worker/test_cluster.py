"""The service end to end on one Redis node and on a real Redis Cluster (3 masters, 3 replicas),
with the same assertions: the producer library -> Redis -> workers -> replay streams and channels
-> consumers, live and late; greedy tokens equal the offline engine's, every seq exactly once and
in order. On the cluster, the token events of a step go out as one pipeline per node that holds a
running request, never one round trip per request."""

import asyncio
import threading

import pytest
import redis

from producer import AsyncProducer, Producer
from producer.connect import connect

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
