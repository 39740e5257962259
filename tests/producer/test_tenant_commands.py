"""`streambatch tenant add|rotate-key|list|remove` (python -m producer tenant ...) as the operator,
on a redis-server loaded with the ACL file: each tenant gets a Redis user with the tenant role and
an API key kept hashed; what is secret goes to a file or is shown once, never anywhere else."""

import hashlib
import json

import pytest
import redis

from producer.acl import OPERATOR_USER, WORKER_USER, users_acl
from producer.cli import main
from producer.protocol import Keys, decode_settings, decode_tenant
from tests.conftest import private_redis

KEYS = Keys("sb")
OPERATOR_PASSWORD = "operator-secret"


@pytest.fixture
def secured(tmp_path):
    """-> (the CLI's connection flags as the operator, host:port, the ACL file)."""
    acl = tmp_path / "users.acl"
    acl.write_text(users_acl(KEYS, {WORKER_USER: ">w", OPERATOR_USER: f">{OPERATOR_PASSWORD}"}))
    secret = tmp_path / "operator-password"
    secret.write_text(OPERATOR_PASSWORD + "\n")
    with private_redis(tmp_path, OPERATOR_PASSWORD, username=OPERATOR_USER, options=("--aclfile", str(acl))) as (url, _):
        host = url.removeprefix("redis://")
        yield ["--redis-url", f"redis://{OPERATOR_USER}@{host}", "--redis-password-file", str(secret)], host, acl


def logs_in(host: str, username: str, password: str) -> bool:
    try:
        return redis.Redis.from_url(f"redis://{host}", username=username, password=password).ping()
    except redis.AuthenticationError:
        return False


def test_add_rotate_list_remove(secured, tmp_path, capsys):
    flags, host, acl = secured
    password_file = tmp_path / "team-a-password"
    assert main(flags + ["tenant", "add", "team-a", "--weight", "2", "--password-file", str(password_file)]) == 0
    out, err = capsys.readouterr()
    api_key, password = out.strip(), password_file.read_text().strip()
    assert api_key.startswith("sbk-") and password_file.stat().st_mode & 0o777 == 0o600
    assert "tenant-team-a" in err and str(password_file) in err and "STREAMBATCH_TENANT=team-a" in err
    assert password not in out + err and OPERATOR_PASSWORD not in out + err
    assert logs_in(host, "tenant-team-a", password) and "user tenant-team-a on" in acl.read_text()
    operator = redis.Redis.from_url(f"redis://{host}", username=OPERATOR_USER, password=OPERATOR_PASSWORD)
    entry = json.loads(operator.hget(KEYS.tenants, "team-a"))
    assert (entry["weight"], entry["api_key_sha256"]) == (2.0, hashlib.sha256(api_key.encode()).hexdigest())
    assert api_key not in str(operator.hgetall(KEYS.tenants)), "only the key's hash is kept"
    assert main(flags + ["tenant", "add", "team-a", "--password-file", str(password_file)]) == 1
    assert "registered already" in capsys.readouterr().err

    assert main(flags + ["tenant", "rotate-key", "team-a", "--password-file", str(password_file)]) == 0
    new_key, new_password = capsys.readouterr().out.strip(), password_file.read_text().strip()
    assert new_key != api_key and not logs_in(host, "tenant-team-a", password)
    assert logs_in(host, "tenant-team-a", new_password)

    assert main(flags + ["tenant", "list", "--json"]) == 0
    assert json.loads(capsys.readouterr().out) == [{"tenant": "team-a", "weight": 2.0, "max_backlog": 10_000,
                                                   "shards": 1, "max_running": None, "user": True}]
    assert main(flags + ["tenant", "set", "team-a", "--weight", "3", "--max-running", "4"]) == 0
    changed = decode_tenant(operator.hget(KEYS.tenants, "team-a"))
    assert (changed.weight, changed.max_running, changed.max_backlog) == (3.0, 4, 10_000)
    assert main(flags + ["tenant", "set", "team-a", "--weight", "0"]) == 1
    assert "weight must be in (0, 1000]" in capsys.readouterr().err
    assert main(flags + ["tenant", "reshard", "team-a", "4"]) == 0
    assert main(flags + ["tenant", "reshard", "team-a", "2"]) == 0
    assert "workers read 4" in capsys.readouterr().err
    entry = decode_tenant(operator.hget(KEYS.tenants, "team-a"))
    settings = decode_settings(operator.get(KEYS.of("team-a").settings))
    assert (entry.shards, entry.max_shards, settings.shards, settings.max_backlog) == (2, 4, 2, 10_000)
    assert main(flags + ["tenant", "reshard", "team-a", "65"]) == 1
    assert "shards must be in [1, 64]" in capsys.readouterr().err
    as_tenant = ["--redis-url", f"redis://tenant-team-a@{host}", "--redis-password-file", str(password_file)]
    assert main(as_tenant + ["tenant", "add", "team-b", "--password-file", str(tmp_path / "b")]) == 1
    assert "no permissions" in capsys.readouterr().err and not (tmp_path / "b").exists()

    assert main(flags + ["tenant", "remove", "team-a"]) == 0
    assert not logs_in(host, "tenant-team-a", new_password) and not operator.hexists(KEYS.tenants, "team-a")
    assert not operator.exists(KEYS.of("team-a").settings)
    assert "tenant-team-a" not in acl.read_text()


def test_nothing_is_issued_when_the_password_file_cannot_be_written_and_a_refusal_keeps_the_old_one(
        secured, tmp_path, capsys):
    flags, host, acl = secured
    assert main(flags + ["tenant", "add", "team-a", "--password-file", str(tmp_path / "missing/dir/pw")]) == 1
    assert "--password-file" in capsys.readouterr().err
    operator = redis.Redis.from_url(f"redis://{host}", username=OPERATOR_USER, password=OPERATOR_PASSWORD)
    assert not operator.hexists(KEYS.tenants, "team-a") and "tenant-team-a" not in acl.read_text()

    kept = tmp_path / "team-a-password"
    assert main(flags + ["tenant", "add", "team-a", "--password-file", str(kept)]) == 0
    password = kept.read_text()
    assert main(flags + ["tenant", "rotate-key", "team-b", "--password-file", str(kept)]) == 1  # no such tenant
    assert "no tenant 'team-b'" in capsys.readouterr().err
    assert kept.read_text() == password and logs_in(host, "tenant-team-a", password.strip())
    assert sorted(path.name for path in tmp_path.iterdir() if "team-a-password" in path.name) == ["team-a-password"]
