"""Fair shares between tenants through Redis: tenants registered with weights and quotas, their
producers, a real worker (the tiny model) reading their streams with weighted shares and scheduling
them by virtual token counters; and the simulator's shares against the real worker's on one trace."""

import collections

import pytest

from producer import Producer, QueueFull
from producer.protocol import Keys, SamplingParams
from producer.tenants import TenantRegistry
from worker.engine.fairness import TenantShare
from worker.engine.scheduler_config import SchedulerConfig
from worker.engine.simulator import SimRequest, simulate

from .conftest import NUM_BLOCKS, greedy, prompts_of, run_until

KEYS = Keys()
TRACE = 24  # requests per tenant, all at once: both backlogged


def tenant_producer(url: str, registry: TenantRegistry, tenant: str, **entry) -> Producer:
    password = registry.add(tenant, **entry).password
    return Producer(url.replace("redis://", f"redis://tenant-{tenant}@"), tenant=tenant, password=password)


def served_while_backlogged(worker, tenants: tuple[str, ...]) -> collections.Counter:
    """Tokens each tenant got from the worker's steps while every tenant had requests waiting."""
    served = collections.Counter()
    step = worker.engine.step

    def counted():
        queues = [worker.engine.scheduler.waiting[lane].by_tenant for lane in ("fast", "normal")]
        backlogged = all(any(queue.get(tenant) for queue in queues) for tenant in tenants)
        outputs = step()
        if backlogged:
            for output in outputs:
                served[worker.flights[output.request_id].keys.tenant] += len(output.token_ids)
        return outputs

    worker.engine.step = counted
    return served


def test_weights_and_quotas_from_the_registry_hold_through_redis_and_match_the_simulator(redis_url, make_worker,
                                                                                     client):
    registry = TenantRegistry(client, KEYS)
    heavy = tenant_producer(redis_url, registry, "heavy", weight=2.0)
    light = tenant_producer(redis_url, registry, "light")
    capped = tenant_producer(redis_url, registry, "capped", max_backlog=3, max_running=2)
    prompts = prompts_of(2 * TRACE, seed=21, low=8, high=24)
    params = greedy(40)
    for i in range(TRACE):
        heavy.submit(prompt_ids=prompts[i], params=params, request_id=f"h{i}", lane="normal")
        light.submit(prompt_ids=prompts[TRACE + i], params=params, request_id=f"l{i}", lane="normal")
    for i in range(3):
        capped.submit(prompt_ids=[5, 6, 7], params=greedy(30), request_id=f"c{i}")
    with pytest.raises(QueueFull):  # its registry backlog, whatever its producer allows
        capped.submit(prompt_ids=[5, 6, 7], params=greedy(30), request_id="c3")
    light.submit(prompt_ids=[5, 6, 7], params=greedy(30), request_id="not-capped")  # the others untouched

    worker = make_worker(intake_ahead=64, engine_options={"token_budget": 64, "num_blocks": NUM_BLOCKS})
    served = served_while_backlogged(worker, ("heavy", "light"))
    running_capped = []
    run_until([worker], lambda: (running_capped.append(worker.engine.scheduler.running_by_tenant["capped"])
                                 or not worker.flights and worker.housekeeping_rounds > 1
                                 and not client.xlen(KEYS.of("heavy").requests("normal"))), timeout=120)
    assert max(running_capped) == 2, "at most max_running of the capped tenant at once, and it reached it"
    real_share = served["heavy"] / (served["heavy"] + served["light"])

    simulated = collections.Counter()

    def count(scheduler, plan):
        if all(scheduler.waiting["normal"].by_tenant.get(tenant) for tenant in ("heavy", "light")):
            for seq, num_tokens in plan.scheduled.items():
                if plan.samples(seq):
                    simulated[seq.tenant] += 1

    trace = [SimRequest(0.0, prompt, SamplingParams(max_tokens=40, ignore_eos=True), lane="normal",
                        request_id=f"{tenant}{i}", tenant=tenant)
             for tenant, offset in (("heavy", 0), ("light", TRACE)) for i, prompt in
             enumerate(prompts[offset:offset + TRACE])]
    simulate(SchedulerConfig(token_budget=64, max_model_len=1024), NUM_BLOCKS, 16, trace,
             tenants={"heavy": TenantShare(weight=2.0)}, on_step=count)
    simulated_share = simulated["heavy"] / (simulated["heavy"] + simulated["light"])
    print(f"heavy's share of the tokens while both were backlogged: real {real_share:.3f}, "
          f"simulated {simulated_share:.3f}")
    assert abs(real_share - simulated_share) <= 0.2 * simulated_share
    assert 0.6 <= real_share <= 0.73  # 2:1
