"""The Redis ACL roles (producer/acl.py) on a real redis-server loaded with their ACL file, the
no one logged in as the default user: each role does its whole job (a request of tenant A from producer to worker to
consumer, cancels, bad entries, stats, the registry), and each is refused, with NOPERM, what it
must not do, attacks on tenant B included. The refusals are counted and printed."""

from pathlib import Path

import pytest
import redis

from producer import Producer
from producer.acl import OPERATOR_USER, WORKER_USER, users_acl
from producer.protocol import FIELD, Request
from producer.tenants import TenantRegistry
from tests.conftest import private_redis

from .conftest import KEYS, greedy, offline, run_until

ROOT = Path(__file__).resolve().parents[2]
TEAM_A, TEAM_B = KEYS.of("team-a"), KEYS.of("team-b")
PASSWORDS = {WORKER_USER: "worker-secret", OPERATOR_USER: "operator-secret"}


def test_the_committed_acl_file_is_the_one_the_layout_makes():
    assert (ROOT / "ops/redis/users.acl").read_text() == users_acl(KEYS), \
        "regenerate it: python -m producer.acl > ops/redis/users.acl"


@pytest.fixture
def secured(tmp_path):
    """-> (URL without user or password, the operator's client)."""
    acl = tmp_path / "users.acl"
    acl.write_text(users_acl(KEYS, {user: f">{password}" for user, password in PASSWORDS.items()}))
    with private_redis(tmp_path, PASSWORDS[OPERATOR_USER], username=OPERATOR_USER,
                       # DEBUG and MODULE allowed from loopback, so that only the ACL refuses them
                       options=("--aclfile", str(acl), "--enable-debug-command", "local",
                                "--enable-module-command", "local")) as (url, _):
        operator = redis.Redis.from_url(url, username=OPERATOR_USER, password=PASSWORDS[OPERATOR_USER])
        yield url, operator
        operator.close()


def as_user(url: str, username: str, password: str) -> redis.Redis:
    return redis.Redis.from_url(url, username=username, password=password)


def refused(attempts: dict[str, object]) -> list[str]:
    """Run each attempt (a callable); -> those that were not refused with NOPERM."""
    allowed = []
    for name, attempt in attempts.items():
        try:
            attempt()
        except redis.exceptions.NoPermissionError:
            continue
        except redis.ResponseError as error:
            if "NOPERM" in str(error):
                continue
            allowed.append(f"{name}: {error}")
        else:
            allowed.append(name)
    return allowed


def refused_subscription(client: redis.Redis, channel: str, pattern: bool = False):
    def attempt():
        subscription = client.pubsub()
        (subscription.psubscribe if pattern else subscription.subscribe)(channel)
        subscription.get_message(timeout=1)
    return attempt


def test_each_role_does_its_whole_job_and_is_refused_everything_else(secured, make_worker, model, tmp_path, capsys):
    url, operator = secured
    registry = TenantRegistry(operator, KEYS)
    team_a, team_b = registry.add("team-a"), registry.add("team-b")
    worker_password = tmp_path / "worker-password"
    worker_password.write_text(PASSWORDS[WORKER_USER] + "\n")
    host = url.removeprefix("redis://")
    worker = make_worker(redis_url=f"redis://{WORKER_USER}@{host}", redis_password_file=str(worker_password))

    # Tenant A's whole job: submit, follow, cancel, its own stats; a bad entry of its own.
    with Producer(f"redis://{team_a.username}@{host}", tenant="team-a", password=team_a.password) as producer:
        handle = producer.submit(prompt_ids=[5, 6, 7], params=greedy(6), request_id="job")
        long = producer.submit(prompt_ids=[5, 6, 7], params=greedy(500), request_id="long")
        a = as_user(url, team_a.username, team_a.password)
        a.xadd(TEAM_A.requests("normal"), {FIELD: b"garbage"})
        run_until([worker], lambda: a.exists(TEAM_A.replay("long")))
        long.cancel()
        run_until([worker], lambda: sum(a.xlen(TEAM_A.requests(lane)) for lane in ("fast", "normal")) == 0)
        assert handle.result(timeout=10).token_ids == offline(model, [[5, 6, 7]], [greedy(6)])[0]
        assert long.result(timeout=10).finish_reason == "cancelled"
        stats = producer.stats()
        assert stats.lanes["normal"].backlog == 0 and stats.workers is None and stats.dead_letters is None
    assert operator.xlen(KEYS.dead_letters) == 1 and len(operator.hgetall(KEYS.tenants)) == 2

    # What tenant A must not do, to B or to anyone.
    b_request = Request(id="theirs", prompt_ids=[5], params=greedy(2))
    b = as_user(url, team_b.username, team_b.password)
    b.xadd(TEAM_B.requests("normal"), {FIELD: b"x"})
    tenant_attempts = {
        "read B's replay stream": lambda: a.xrange(TEAM_B.replay("theirs")),
        "read B's queued prompts": lambda: a.xrange(TEAM_B.requests("normal")),
        "read B's submission": lambda: a.get(TEAM_B.submitted("theirs")),
        "subscribe to B's channel": refused_subscription(a, TEAM_B.tokens("theirs")),
        "subscribe to every channel": refused_subscription(a, "*", pattern=True),
        "XADD to B's stream": lambda: a.xadd(TEAM_B.requests("fast"), {FIELD: b_request.id}),
        "cancel B's request": lambda: a.set(TEAM_B.cancelled("theirs"), 1),
        "nudge B's cancel channel": lambda: a.publish(TEAM_B.cancel_channel, "theirs"),
        "read the registry": lambda: a.hgetall(KEYS.tenants),
        "pin a prefix": lambda: a.hset(KEYS.pins, "mine", b"x"),
        "read the dead letters": lambda: a.xrange(KEYS.dead_letters),
        "read a heartbeat": lambda: a.get(KEYS.worker("w1")),
        "forge an event in its own replay stream": lambda: a.xadd(TEAM_A.replay("job"), {FIELD: b"x"}),
        "DEL its own lane stream": lambda: a.delete(TEAM_A.requests("normal")),
        "overwrite its own lane stream": lambda: a.set(TEAM_A.requests("normal"), "x"),
        "FLUSHALL": lambda: a.flushall(),
        "CONFIG": lambda: a.config_get("*"),
        "KEYS": lambda: a.keys("*"),
        "SCAN": lambda: a.scan(0),
        "SCRIPT FLUSH": lambda: a.script_flush(),
        "DEBUG": lambda: a.execute_command("DEBUG", "SLEEP", "0"),
        "MODULE": lambda: a.execute_command("MODULE", "LIST"),
        "EVAL": lambda: a.eval("return 1", 0),
        "MONITOR": lambda: a.execute_command("MONITOR"),
        "ACL SETUSER": lambda: a.execute_command("ACL", "SETUSER", "mine", "on"),
        "CLIENT LIST": lambda: a.client_list(),
    }
    w = as_user(url, WORKER_USER, PASSWORDS[WORKER_USER])
    admin = {"FLUSHALL": lambda client: client.flushall(), "CONFIG": lambda client: client.config_get("*"),
             "KEYS": lambda client: client.keys("*"), "SCRIPT FLUSH": lambda client: client.script_flush(),
             "DEBUG": lambda client: client.execute_command("DEBUG", "SLEEP", "0"),
             "MODULE": lambda client: client.execute_command("MODULE", "LIST"),
             "MONITOR": lambda client: client.execute_command("MONITOR"),
             "SHUTDOWN": lambda client: client.execute_command("SHUTDOWN", "NOSAVE")}
    worker_attempts = {name: (lambda attempt=attempt: attempt(w)) for name, attempt in admin.items()} | {
        "ACL SETUSER": lambda: w.execute_command("ACL", "SETUSER", "mine", "on"), "EVAL": lambda: w.eval("return 1", 0)}
    operator_attempts = {name: (lambda attempt=attempt: attempt(operator)) for name, attempt in admin.items()} | {
        "EVAL": lambda: operator.eval("return 1", 0),
        "XADD to a tenant's stream": lambda: operator.xadd(TEAM_A.requests("fast"), {FIELD: b"x"})}
    for role, attempts in (("tenant", tenant_attempts), ("worker", worker_attempts), ("operator", operator_attempts)):
        assert refused(attempts) == [], f"the {role} role was let do these"
    with pytest.raises(redis.AuthenticationError):
        redis.Redis.from_url(url).ping()  # not logged in: no one is the default user
    with capsys.disabled():
        print(f"\nACL refusals: tenant {len(tenant_attempts)}, worker {len(worker_attempts)}, "
              f"operator {len(operator_attempts)}, default user 1")
