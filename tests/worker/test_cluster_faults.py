"""Faults on a real Redis Cluster (3 masters, each with a replica, a node timeout of 1 s) under a
steady load of mixed requests through the cluster producer, each followed live, against
`python -m worker --redis-cluster` processes:
- the master holding the most live requests' keys is SIGKILLed mid-load, and the worker holding
  the most live requests is kill -9'd during the failover: the replica takes over, the worker's
  requests are reclaimed as on one node, every request completes or ends with a clear error (none
  hangs), and what the failover lost is counted: writes the master acknowledged but had not yet
  sent to its replica (Redis Cluster replicates asynchronously; README, Scaling);
- a live slot migration (`redis-cli --cluster reshard`) of slots holding in-flight requests' keys:
  no event is lost or repeated, every token equals an undisturbed run.
Each test prints its figures (`pytest -s`)."""

import contextlib
import signal
import subprocess
import time
from collections import Counter

import pytest

from producer.connect import connect
from producer.protocol import TERMINAL
from tests.conftest import private_cluster
from tests.waiting import wait_for

from .conftest import KEYS
from .faults import Load, Workers, check, expected_tokens, in_flight, mixed, replay

pytestmark = pytest.mark.timeout(600)
RATE = 6.0  # requests per second: both workers busy, none overloaded


def report(title: str, findings, **figures) -> None:
    print(f"\n[{title}] " + ", ".join(f"{name}={value}" for name, value in figures.items()))
    print(f"[{title}] {findings.figures()}")
    for problem in findings.problems[:30]:
        print(f"[{title}]   {problem}")


def live_slots(client, held: dict[str, list[str]]) -> Counter:
    """The hash slots of the live requests' keys (one per request: its keys share a tag)."""
    return Counter(client.keyslot(KEYS.replay(request_id)) for ids in held.values() for request_id in ids)


def ended(client, request_id: str) -> bool:
    """Its replay stream ends with a terminal event, or it is gone (lost with a master)."""
    events = replay(client, request_id)
    return not events or isinstance(events[-1], TERMINAL)


@contextlib.contextmanager
def loaded(tmp_path, prefix: str, *flags: str):
    """-> (cluster, workers, load, held): two workers on a private cluster under the steady load,
    once at least four requests are in flight (`held`: by worker)."""
    with private_cluster(tmp_path / "cluster") as cluster:
        workers = Workers(cluster.url, tmp_path, *flags, cluster=True)
        try:
            for name in ("a", "b"):
                workers.start(name)
            workers.wait_ready(["a", "b"], timeout=120)
            load = Load(cluster.url, mixed(prefix, normal_tokens=(200, 500)), rate=RATE, cluster=True).start()
            held = wait_for(lambda: (found := in_flight(workers.client)) and sum(map(len, found.values())) >= 4
                            and found, 60, "requests in flight")
            yield cluster, workers, load, held
        finally:
            workers.close()


def owner(cluster, slot: int) -> dict:
    for node in cluster.nodes():
        if node["master"] and node["alive"]:
            for span in node["slots"]:
                low, _, high = span.partition("-")
                if not span.startswith("[") and int(low) <= slot <= int(high or low):
                    return node
    raise AssertionError(f"no live master serves slot {slot}")


@pytest.mark.long
def test_a_master_killed_mid_load_fails_over_and_a_worker_killed_meanwhile_is_reclaimed(tmp_path, model):
    with loaded(tmp_path, "f", "--max-deliveries", "100") as (cluster, workers, load, held):
        client = workers.client
        slots = live_slots(client, held)
        master = Counter({owner(cluster, slot)["port"]: 0 for slot in slots})
        for slot, count in slots.items():
            master[owner(cluster, slot)["port"]] += count
        port, keys_there = master.most_common(1)[0]
        cluster.processes[port].send_signal(signal.SIGKILL)
        killed_at = time.monotonic()
        victim = max(held, key=lambda name: len(held[name]))
        workers.kill(victim)  # mid-batch, during the failover
        wait_for(lambda: len(cluster.masters()) == 3 and port not in cluster.masters(), 60, "no failover")
        failover_s = time.monotonic() - killed_at
        workers.url = cluster.live_url()  # the restart's URL names a node that runs
        workers.start(victim)
        workers.wait_ready([victim], timeout=120)
        time.sleep(3)  # the load goes on past the failover
        load.stop(timeout=240)
        client = connect(cluster.live_url(), cluster=True)
        # A request whose last writes died with the master (its finish included) is pending again on
        # the new one: reclaimed, it is finished again, from what its replay stream holds.
        wait_for(lambda: all(ended(client, followed.spec.request_id) for followed in load.accepted), 120,
                 "requests whose end the failover lost were not finished again")
        rewritten = [followed.spec.request_id for followed in load.accepted if followed.end == "done"
                     and replay(client, followed.spec.request_id)[-1].attempt > followed.events[-1].attempt]
        findings = check(client, load, expected_tokens(model, [followed.spec for followed in load.accepted]),
                         allowed_ends=("done", "EventsLost", "UnknownRequest"))
    lost = [problem for problem in findings.problems if problem.startswith("allowed:")]
    # What the failover lost of acknowledged writes: whole requests (their consumers told EventsLost or
    # UnknownRequest, at once), and the last events of others, which their consumers had seen and a
    # reclaim wrote again (the same tokens, a later attempt).
    report("master killed", findings, failover_s=round(failover_s, 2), live_keys_on_the_killed_master=keys_there,
           worker_killed=victim, requests_in_flight_on_it=len(held[victim]), requests_lost_to_the_failover=len(lost),
           ends_lost_and_written_again=len(rewritten))
    tails = [problem for problem in findings.problems if problem.startswith("mismatches") and
             any(request_id in problem for request_id in rewritten) and "differs from what the consumer saw" in problem]
    assert (findings.losses, findings.duplicates, findings.mismatches - len(tails)) == (0, 0, 0), findings.problems[:10]
    assert findings.resumed > 0, "the killed worker's requests were finished by another attempt"
    assert findings.completed + len(lost) == len(load.accepted), "every request ended, none hangs"


@pytest.mark.long
def test_a_live_slot_migration_of_in_flight_requests_loses_and_repeats_nothing(tmp_path, model):
    with loaded(tmp_path, "m") as (cluster, workers, load, held):
        client = workers.client
        # redis-cli moves a master's slots lowest first: enough of them to take three live requests' keys
        by_master: dict[int, list[int]] = {}
        for slot in live_slots(client, held):
            by_master.setdefault(owner(cluster, slot)["port"], []).append(slot)
        port, slots = max(by_master.items(), key=lambda item: len(item[1]))
        source = owner(cluster, min(slots))
        target = next(node for node in cluster.nodes() if node["master"] and node["port"] != port)
        first = int(source["slots"][0].split("-")[0])
        moved = sorted(slots)[min(2, len(slots) - 1)] - first + 1
        started = time.monotonic()
        subprocess.run(["redis-cli", "--cluster", "reshard", f"127.0.0.1:{port}", "--cluster-from", source["id"],
                        "--cluster-to", target["id"], "--cluster-slots", str(moved), "--cluster-yes"],
                       check=True, capture_output=True, timeout=180)
        migration_s = time.monotonic() - started
        assert owner(cluster, min(slots))["port"] == target["port"], "the live requests' slots moved"
        time.sleep(3)
        load.stop(timeout=240)
        findings = check(client, load, expected_tokens(model, [followed.spec for followed in load.accepted]))
    report("live migration", findings, slots_moved=moved, live_requests_moved=sum(slot < first + moved for slot in
                                                                                   slots),
           migration_s=round(migration_s, 2))
    assert (findings.losses, findings.duplicates, findings.mismatches) == (0, 0, 0), findings.problems[:10]
    assert findings.completed == len(load.accepted)
