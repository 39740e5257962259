"""ops/redis/start.sh, compose's Redis start, run here on a real redis-server: the committed ACL
file with the secrets' hashes filled in, no one able to log in as the default user, tenant users that outlive a
restart, a rotated worker password that takes effect at the next start, and a missing secret
that stops the start with one line."""

import os
import subprocess
from pathlib import Path

import pytest
import redis

from producer.acl import OPERATOR_USER, WORKER_USER, tenant_user
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
