"""ops/redis/start.sh, compose's Redis start, run here on a real redis-server: the committed ACL
file with the secrets' hashes filled in, no one able to log in as the default user, tenant users that outlive a
restart, a rotated worker password that takes effect at the next start, and a missing secret
that stops the start with one line."""

import os
import subprocess
from pathlib import Path

import pytest
import redis

from ops.local_cluster import LocalCluster, free_node_port
from producer.acl import OPERATOR_USER, REPLICATOR_USER, WORKER_USER, tenant_user
from producer.protocol import Keys
from producer.tenants import TenantRegistry
from tests.conftest import private_redis

ROOT = Path(__file__).resolve().parents[2]
START = ROOT / "ops/redis/start.sh"


@pytest.fixture
def layout(tmp_path):
    secrets = tmp_path / "secrets"
    secrets.mkdir()
    for user in (WORKER_USER, OPERATOR_USER):
        (secrets / f"redis_{user}_password").write_text(f"{user}-secret-1\n")
    data = tmp_path / "data"
    data.mkdir()
    env = os.environ | {"ACL_TEMPLATE": str(ROOT / "ops/redis/users.acl"), "SECRETS_DIR": str(secrets),
                        "ACL_FILE": str(data / "users.acl")}
    return secrets, data, env


def started(data, env, password: str, options: tuple[str, ...] = ()):
    return private_redis(data, password, username=OPERATOR_USER, launcher=("sh", str(START)), env=env,
                         options=options)


def refuses(url: str, **credentials) -> bool:
    try:
        redis.Redis.from_url(url, **credentials).ping()
    except redis.AuthenticationError:
        return True
    except redis.ResponseError as error:
        return "NOAUTH" in str(error)
    return False


def test_the_roles_log_in_with_their_secrets_and_no_one_as_the_default_user(layout):
    secrets, data, env = layout
    with started(data, env, "operator-secret-1") as (url, _):
        assert redis.Redis.from_url(url, username=WORKER_USER, password="worker-secret-1").ping()
        assert refuses(url), "the default user answered"
        assert refuses(url, username="default", password="")
        assert refuses(url, username=WORKER_USER, password="operator-secret-1")
        operator = redis.Redis.from_url(url, username=OPERATOR_USER, password="operator-secret-1")
        with pytest.raises(redis.exceptions.NoPermissionError):
            operator.execute_command("CONFIG", "GET", "requirepass")
    saved = (data / "users.acl").read_text()
    assert "worker-secret-1" not in saved and "PASSWORD_SHA256" not in saved, "a secret or a placeholder left"
    assert oct((data / "users.acl").stat().st_mode & 0o777) == "0o600"


def test_tenant_users_outlive_a_restart_and_a_rotated_worker_password_takes_effect(layout):
    secrets, data, env = layout
    with started(data, env, "operator-secret-1") as (url, _):
        operator = redis.Redis.from_url(url, username=OPERATOR_USER, password="operator-secret-1")
        issued = TenantRegistry(operator, Keys()).add("team-a")
        assert issued.persisted
    (secrets / "redis_worker_password").write_text("worker-secret-2\n")
    with started(data, env, "operator-secret-1") as (url, _):
        assert redis.Redis.from_url(url, username=tenant_user("team-a"), password=issued.password).ping()
        assert refuses(url, username=WORKER_USER, password="worker-secret-1")
        assert redis.Redis.from_url(url, username=WORKER_USER, password="worker-secret-2").ping()
    assert (data / "users.acl").read_text().count(f"user {tenant_user('team-a')} ") == 1


def test_a_missing_secret_stops_the_start_with_one_line(layout):
    secrets, data, env = layout
    (secrets / "redis_operator_password").unlink()
    done = subprocess.run(["sh", str(START), "--port", "0"], env=env, capture_output=True, text=True, timeout=30)
    assert done.returncode == 1
    assert "redis_operator_password is missing or empty" in done.stderr
    assert not (data / "users.acl").exists()


def test_what_transactions_wrote_survives_a_restart_from_the_append_only_file(layout):
    """Redis replays an AOF's MULTI/EXEC blocks as the default user and, with that user off, drops
    them without a word (redis/redis#14541): a submit (XADD + SET in one MULTI) and every fenced
    event write (a script, logged as MULTI/EXEC) would be gone after a restart."""
    secrets, data, env = layout
    options = ("--appendonly", "yes", "--appendfsync", "always")
    with started(data, env, "operator-secret-1", options) as (url, _):
        worker = redis.Redis.from_url(url, username=WORKER_USER, password="worker-secret-1")
        with worker.pipeline(transaction=True) as pipe:
            pipe.xadd(Keys().requests("normal"), {"m": b"entry"}).set(Keys().submitted("kept"), b"queued")
            pipe.execute()
        worker.set(Keys().attempt("plain"), b"1")
    with started(data, env, "operator-secret-1", options) as (url, _):
        worker = redis.Redis.from_url(url, username=WORKER_USER, password="worker-secret-1")
        assert worker.get(Keys().attempt("plain")) == b"1"
        assert worker.xlen(Keys().requests("normal")) == 1 and worker.get(Keys().submitted("kept")) == b"queued"


def test_six_nodes_started_for_the_cluster_profile_are_formed_once_and_replicate_as_the_replicator(tmp_path):
    """compose's cluster profile, without the containers: six start.sh nodes (REDIS_CLUSTER_NODE, each
    on a loopback address of its own and the same port, as each container has its host name), formed
    by cluster-init.sh as the operator; each replica logs in to its master as `replicator`, with the
    password only its config file holds; a second run of cluster-init.sh leaves the cluster as it is."""
    secrets = tmp_path / "secrets"
    secrets.mkdir()
    for user in (WORKER_USER, OPERATOR_USER, REPLICATOR_USER):
        (secrets / f"redis_{user}_password").write_text(f"{user}-secret\n")
    port = free_node_port()
    hosts = [f"127.0.0.1{i}" for i in range(6)]  # NODE_PREFIX 127.0.0.1 + 0..5: all loopback
    nodes = []
    try:
        for host in hosts:
            data = tmp_path / host
            data.mkdir()
            env = os.environ | {"ACL_TEMPLATE": str(ROOT / "ops/redis/users.acl"), "SECRETS_DIR": str(secrets),
                                "ACL_FILE": str(data / "users.acl"), "REDIS_CLUSTER_NODE": host,
                                "REDIS_CLUSTER_NODE_TIMEOUT_MS": "1000"}
            # (--cluster-announce-ip: a container's address is its own; here connections leave from 127.0.0.1)
            nodes.append(subprocess.Popen(["sh", str(START), "--port", str(port), "--bind", host, "--dir", str(data),
                                           "--cluster-announce-ip", host, "--save", "", "--appendonly", "no"], env=env,
                                          stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        operators = [redis.Redis(host=host, port=port, username=OPERATOR_USER, password="operator-secret")
                     for host in hosts]
        LocalCluster.wait(lambda: all(node.ping() for node in operators), "the nodes up")
        replication = (tmp_path / hosts[0] / "replication.conf")
        assert replication.read_text() == "masteruser replicator\nmasterauth replicator-secret\n"
        assert oct(replication.stat().st_mode & 0o777) == "0o600"
        env = os.environ | {"SECRETS_DIR": str(secrets), "NODE_PREFIX": "127.0.0.1", "REDIS_PORT": str(port)}
        formed = subprocess.run(["sh", str(ROOT / "ops/redis/cluster-init.sh")], env=env, capture_output=True,
                                text=True, timeout=120)
        assert formed.returncode == 0, formed.stdout[-500:] + formed.stderr[-500:]
        assert "operator-secret" not in formed.stdout + formed.stderr
        LocalCluster.wait(lambda: sum(node.info("replication")["role"] == "slave" and
                               node.info("replication")["master_link_status"] == "up" for node in operators) == 3,
                   "three replicas linked to their masters")
        cluster = redis.RedisCluster(host=hosts[0], port=port, username=WORKER_USER, password="worker-secret")
        assert {node.host for node in cluster.get_primaries()} <= set(hosts), "nodes announced by their names"
        cluster.set("sb:key", "value")
        again = subprocess.run(["sh", str(ROOT / "ops/redis/cluster-init.sh")], env=env, capture_output=True,
                               text=True, timeout=60)
        assert again.returncode == 0 and "formed already" in again.stdout
        assert cluster.get("sb:key") == b"value"
    finally:
        for node in nodes:
            node.kill()
            node.wait()
