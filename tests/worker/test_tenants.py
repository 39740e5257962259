"""Tenants on one Redis and one worker (layout v2): each tenant's requests live under its own
prefix, a request's tenant is its stream's, an id is owned by the entry that brought it, and a
cancel is its owner's key, not a message anyone may publish. Attacks are made as a tenant
would make them: raw XADDs and PUBLISHes inside its own part of the layout."""

import msgspec
import pytest

from producer import Producer
from producer.errors import QueueFull
from producer.protocol import FIELD, LANES, Keys, Request, Tenant, encode
from worker.config import WorkerConfig
from worker.engine.config import EngineConfig
from worker.engine.engine import Engine
from worker.service import Worker

from .conftest import KEYS, MODEL, greedy, is_finished, offline, paced, replay, run_until, submit, tokens_of

TEAM_A, TEAM_B = KEYS.of("team-a"), KEYS.of("team-b")


def register(client, *tenants: Keys) -> None:
    for keys in tenants:
        client.hset(KEYS.tenants, keys.tenant, msgspec.json.encode(Tenant()))


def test_every_key_of_a_tenant_is_under_its_prefix_and_shared_ones_under_none():
    request_keys = [TEAM_A.replay("x"), TEAM_A.tokens("x"), TEAM_A.cancelled("x"), TEAM_A.attempt("x"),
                    TEAM_A.submitted("x")]
    streams = [TEAM_A.requests("fast"), TEAM_A.requests("normal"), TEAM_B.requests("fast")]
    assert all(name.startswith("sb:t:team-a:") for name in request_keys + streams[:2] + [TEAM_A.cancel_channel])
    assert {hash_tag(name) for name in request_keys} == {"x"}, "one slot per request"
    assert len({hash_tag(name) for name in streams}) == 3, "a slot per (tenant, lane, shard)"
    for shared in (KEYS.dead_letters, KEYS.worker("w"), KEYS.pins, KEYS.tenants):
        assert not shared.startswith("sb:t:")
    with pytest.raises(ValueError, match="tenant name"):
        Keys("sb", "Team:A")


def hash_tag(name: str) -> str:
    return name[name.index("{") + 1:name.index("}")]


def test_two_tenants_with_the_same_id_each_get_their_own_request(make_worker, client, model):
    register(client, TEAM_A, TEAM_B)
    worker = make_worker()
    prompts = [[5, 6, 7], [9, 10, 11, 12]]
    submit(client, Request(id="same", prompt_ids=prompts[0], params=greedy(8)), keys=TEAM_A)
    submit(client, Request(id="same", prompt_ids=prompts[1], params=greedy(8)), keys=TEAM_B)
    run_until([worker], lambda: is_finished(client, "same", TEAM_A) and is_finished(client, "same", TEAM_B))
    expected = offline(model, prompts, [greedy(8)] * 2)
    assert [tokens_of(replay(client, "same", keys)) for keys in (TEAM_A, TEAM_B)] == expected
    assert replay(client, "same") == [], "nothing written to the default tenant"


def test_a_tenant_registered_later_is_served_from_the_next_heartbeat(make_worker, client):
    worker = make_worker()
    submit(client, Request(id="late", prompt_ids=[5, 6], params=greedy(3)), keys=TEAM_A)
    for _ in range(3):
        worker.poll()
    assert not is_finished(client, "late", TEAM_A), "an unregistered tenant is not served"
    register(client, TEAM_A)
    client.hset(KEYS.tenants, "Bad Name", b"{}")  # refused, and the rest still served
    client.hset(KEYS.tenants, "team-c", b'{"weight": -1}')
    worker.next_housekeeping = 0
    run_until([worker], lambda: is_finished(client, "late", TEAM_A))
    assert worker.streams.tenants == ["default", "team-a"]


@pytest.mark.parametrize("victim_state", ["queued", "running"])
def test_another_tenants_entry_carrying_a_victims_id_is_a_request_of_its_own(make_worker, client, model,
                                                                            victim_state):
    """The red team's hijack, as one team against another: an XADD of the attacker's own stream
    (the fast lane: read first) with the victim's id. In one shared layout the attacker's prompt
    ran under the victim's id (queued victim), or fenced the running victim off and continued its
    stream. Now the attacker's entry is a request of the attacker's tenant: the victim's id there."""
    register(client, TEAM_A, TEAM_B)
    worker = paced(make_worker())
    victim = Request(id="victim", prompt_ids=[5, 6, 7], params=greedy(30))
    attack = Request(id="victim", prompt_ids=[400, 401], params=greedy(30))
    submit(client, victim, keys=TEAM_A)
    if victim_state == "running":
        run_until([worker], lambda: len(tokens_of(replay(client, "victim", TEAM_A))) >= 2)
    submit(client, attack, lane="fast", keys=TEAM_B)
    run_until([worker], lambda: is_finished(client, "victim", TEAM_A) and is_finished(client, "victim", TEAM_B))
    victims, attackers = replay(client, "victim", TEAM_A), replay(client, "victim", TEAM_B)
    assert [tokens_of(victims), tokens_of(attackers)] == offline(model, [victim.prompt_ids, attack.prompt_ids],
                                                                 [victim.params, attack.params])
    assert {event.attempt for event in victims} == {1} and client.xlen(KEYS.dead_letters) == 0


def test_a_second_entry_with_a_running_requests_id_neither_fences_nor_writes_into_it(make_worker, client, model):
    """Inside one tenant, read by a worker that does not hold the first entry: its claim used to
    move the attempt key on, fencing the real owner off, and continue the stream with its prompt."""
    holder, other = paced(make_worker("w1")), make_worker("w2")
    victim = Request(id="victim", prompt_ids=[5, 6, 7], params=greedy(30))
    submit(client, victim)
    run_until([holder], lambda: len(tokens_of(replay(client, "victim"))) >= 2)
    second = submit(client, Request(id="victim", prompt_ids=[400, 401], params=greedy(30)))
    run_until([other], lambda: client.xlen(KEYS.dead_letters) == 1)
    assert other.flights == {}
    run_until([holder], lambda: is_finished(client, "victim"))
    events = replay(client, "victim")
    assert tokens_of(events) == offline(model, [victim.prompt_ids], [victim.params])[0]
    assert {event.attempt for event in events} == {1}
    [(_, letter)] = client.xrange(KEYS.dead_letters)
    assert letter[b"entry_id"].decode() == second and b"belongs to another entry" in letter[b"reason"]


def test_a_bare_publish_on_the_cancel_channel_stops_nothing_and_a_real_cancel_stops_at_once(make_worker, client):
    worker = paced(make_worker())
    submit(client, Request(id="r", prompt_ids=[5, 6, 7], params=greedy(200)))
    run_until([worker], lambda: len(tokens_of(replay(client, "r"))) >= 1)
    worker.next_housekeeping = float("inf")  # no sweep of the cancel keys from here: only the nudges count
    client.publish(KEYS.cancel_channel, "r")  # what anyone allowed on the channel can do
    client.set(TEAM_B.cancelled("r"), 1)  # another tenant's cancel of "its" r
    client.publish(TEAM_B.cancel_channel, "r")
    for _ in range(20):
        worker.poll()
    assert not is_finished(client, "r")
    client.set(KEYS.cancelled("r"), 1)  # the owner's cancel: the key, then the nudge
    client.publish(KEYS.cancel_channel, "r")
    run_until([worker], lambda: is_finished(client, "r"), timeout=5)
    assert replay(client, "r")[-1].finish_reason == "cancelled"


def test_a_worker_refuses_to_start_over_the_old_layouts_live_streams(redis_url, client, model):
    client.xadd(KEYS.v1_requests("normal"), {FIELD: encode(Request(prompt_ids=[5]))})
    engine = EngineConfig.from_options(MODEL, num_blocks=64)
    config = WorkerConfig(engine=engine, name="w1", redis_url=redis_url)
    with pytest.raises(ValueError, match=r"1 requests in the streams of the layout before tenants \(sb:req:normal\)"
                                         r": drain them with the previous release's workers"):
        Worker(config, engine=Engine(engine, model=model))


def test_another_tenants_identical_prompt_is_not_served_from_the_prefix_cache(make_worker, client, model):
    register(client, TEAM_A, TEAM_B)
    worker = make_worker()
    secret = list(range(100, 150))  # three full blocks of 16
    for request_id, keys in (("first", TEAM_A), ("probe", TEAM_B), ("again", TEAM_A)):
        submit(client, Request(id=request_id, prompt_ids=secret, params=greedy(4)), keys=keys)
        run_until([worker], lambda: is_finished(client, request_id, keys))
    cached = {request_id: replay(client, request_id, keys)[-1].usage.cached_tokens
              for request_id, keys in (("first", TEAM_A), ("probe", TEAM_B), ("again", TEAM_A))}
    assert cached == {"first": 0, "probe": 0, "again": 48}
    assert tokens_of(replay(client, "probe", TEAM_B)) == offline(model, [secret], [greedy(4)])[0]


def test_one_tenants_flood_fills_only_its_own_queue(redis_url, client):
    """The red team's 20,000 XADDs in 0.2 s made every team's submit raise QueueFull."""
    with client.pipeline(transaction=False) as pipe:
        for lane in LANES:
            for index in range(120):
                pipe.xadd(TEAM_A.requests(lane), {FIELD: encode(Request(id=f"{lane}{index}", prompt_ids=[5]))})
        pipe.execute()
    with Producer(redis_url, tenant="team-a", max_backlog=100) as team_a, \
            Producer(redis_url, tenant="team-b", max_backlog=100) as team_b:
        assert team_b.submit(prompt_ids=[5, 6], params=greedy(2)).id
        with pytest.raises(QueueFull):
            team_a.submit(prompt_ids=[5, 6], params=greedy(2))
