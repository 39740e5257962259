"""python -m ops.compose_smoke: compose.yaml's CPU stack built and run for real, with rootful podman
and podman-compose, end to end. Each step is timed and checked; the first failure ends the run.

    sudo .venv/bin/python -m ops.compose_smoke [--workers 2] [--json out.json] [--keep] [--skip-gpu-branch]

  1. stand-in images for what cannot be pulled here (ops/compose/standins.Containerfile): a Debian
     bookworm base from debootstrap (made once), Python 3.11, Redis and Prometheus from Debian;
  2. a package index on 127.0.0.1 with the pinned torch (what `pip download` finds on this machine);
  3. the worker image, from our Dockerfile unchanged, on the Python stand-in: `podman-compose build`;
     and the gateway's light image (also the tools service's): no torch, no worker, and its size;
  4. `podman-compose up` of the CPU profile with --workers workers and Prometheus: until Redis and
     every worker pass their healthchecks (podman here has no systemd to schedule them, so the
     smoke runs them: `podman healthcheck run`);
  5. a tenant registered by the tools service (`run --rm tools tenant add`), and its request from
     the host, through the producer CLI as that tenant on the published Redis port: its tokens;
     then one through the gateway's published port with the tenant's API key (the openai package),
     and a wrong key refused;
  6. a long request whose worker is killed with `podman kill -s KILL` mid-generation: another
     finishes it, every seq exactly once, its tokens those of an undisturbed run;
  7. Prometheus's targets API: every worker up; then the cluster profile: six Redis nodes formed
     by redis-cluster-init, a tenant registered on it by the tools service in cluster mode, and its
     request through gateway-cluster, answered by worker-cluster as the single node's was;
  8. the hardening, on the running containers (`podman inspect`, `podman exec`): users, read-only
     roots, no capabilities, no-new-privileges, pid and memory limits, no compiler in the worker,
     no password in any environment, command line or process argument list; Redis refusing a
     client without a password, and the tenant what its ACL user may not do;
  9. `podman-compose down`, then `up`: step 5's events are still in Redis (AOF on the volume);
 10. the GPU profiles rendered by `podman-compose config`, and the Dockerfile's branch for a base
     that brings its own torch (the CUDA one) built on a stand-in with torch inside;
then `down -v`, unless --keep. The project is `streambatch-smoke`: its own containers, network
and volumes. README's Deploy section says what a user with Docker runs instead.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import http.server
import json
import os
import re
import secrets
import shutil
import socket
import ssl
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import openai
import redis
import yaml
from rich.console import Console

from ops.demo import free_port
from ops.tool import ToolError, run_tool
from producer import Producer
from producer.acl import GATEWAY_USER, OPERATOR_USER, REPLICATOR_USER, SERVICE_USERS, WORKER_USER, tenant_user
from producer.protocol import FIELD, GROUP, DoneEvent, Keys, SamplingParams, TokenEvent, decode_event, read_password
from producer.tenants import API_KEY_PREFIX
from worker.heartbeat import worker_of
from worker.entries import usable_id

ROOT = Path(__file__).resolve().parents[1]
HERE = ROOT / "ops" / "compose"
PROJECT = "streambatch-smoke"
STANDIN = "localhost/streambatch-standin"
DEBIAN = f"{STANDIN}/debian:bookworm"
CONTAINER_USER = "10001:10001"  # the worker image's (and the tools service's here)
TENANT = "smoke"
INDEX_PORT = 45120  # the package index's: a build argument, so a port new each run would rebuild the image
KEYS = Keys()


class SmokeError(ToolError):
    """A step that did not hold (run_tool prints it as one line)."""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ops.compose_smoke", description=__doc__.split("\n")[0])
    parser.add_argument("--workers", type=int, default=2, help="CPU worker replicas (--scale)")
    parser.add_argument("--json", type=Path, help="also write the figures here")
    parser.add_argument("--keep", action="store_true", help="leave the stack running (down -v it yourself)")
    parser.add_argument("--skip-gpu-branch", action="store_true",
                        help="do not build the Dockerfile's branch for a base with its own torch (minutes)")
    args = parser.parse_args(argv)
    console = Console()
    return run_tool("compose smoke", lambda: Smoke(console, args).run(), console)


class Smoke:
    def __init__(self, console: Console, args: argparse.Namespace) -> None:
        self.console, self.args = console, args
        self.figures: dict[str, object] = {}
        self.scratch = Path(tempfile.mkdtemp(prefix="streambatch-smoke-"))
        self.secrets = self.scratch / "secrets"
        self.passwords = {user: secrets.token_urlsafe(24) for user in SERVICE_USERS}
        self.password = self.passwords[OPERATOR_USER]  # the smoke's own client is the operator
        self.redis_port, self.prometheus_port, self.gateway_port = free_port(), free_port(), free_port()
        self.cluster_gateway_port = free_port()
        self.index_port = port_or_free(INDEX_PORT)  # the same one each run, or the build's cache misses
        podman_compose = shutil.which("podman-compose", path=str(Path(sys.executable).parent))
        self.podman_compose = podman_compose or shutil.which("podman-compose")
        self.environ = os.environ | {
            "CONTAINERS_CONF": str(HERE / "containers.conf"),
            "BUILDAH_FORMAT": "docker",  # keeps the image's HEALTHCHECK (the OCI format has none)
            "REDIS_WORKER_PASSWORD_FILE": str(self.secret(WORKER_USER)),
            "REDIS_OPERATOR_PASSWORD_FILE": str(self.secret(OPERATOR_USER)),
            "REDIS_GATEWAY_PASSWORD_FILE": str(self.secret(GATEWAY_USER)),
            "REDIS_REPLICATOR_PASSWORD_FILE": str(self.secret(REPLICATOR_USER)),
            "GATEWAY_PORTS": str(self.gateway_port),
            "GATEWAY_CLUSTER_PORTS": str(self.cluster_gateway_port),
            "TOOLS_USER": CONTAINER_USER,
            "TENANT_SECRETS_DIR": str(self.secrets / "tenants"),
            "SMOKE_REDIS_PORT": str(self.redis_port),
            "PROMETHEUS_PORT": str(self.prometheus_port),
            "COMPOSE_PROFILES": "",
        }
        self.redis_url = f"redis://{OPERATOR_USER}@127.0.0.1:{self.redis_port}/0"
        self.tenant_url = f"redis://{tenant_user(TENANT)}@127.0.0.1:{self.redis_port}/0"
        self.tenant_password_file = self.secrets / "tenants" / f"{TENANT}.password"
        self.run_id = secrets.token_hex(3)  # in the request ids: this run's own

    # --- the run -------------------------------------------------------------------------
    def run(self) -> None:
        try:
            self.preflight()
            self.teardown()  # what an interrupted run left
            self.stack()
        finally:
            if not self.args.keep:
                shutil.rmtree(self.scratch, ignore_errors=True)
        self.console.print_json(data=self.figures)
        if self.args.json is not None:
            self.args.json.write_text(json.dumps(self.figures, indent=2))

    def stack(self) -> None:
        with self.package_index() as index_url:
            self.environ["SMOKE_TORCH_INDEX_URL"] = index_url
            try:
                with self.step("stand-in images"):
                    self.standins(index_url)
                with self.step("worker image build", "build_s"):
                    self.compose("--podman-build-args=--network=host", "build", "worker-cpu")
                with self.step("gateway image build (the light image: no torch)", "gateway_build_s"):
                    self.compose("--podman-build-args=--network=host", "build", "gateway")
                    self.gateway_image_is_light()
                self.up("up, until every healthcheck passes", "healthy_s")
                with self.step("a tenant registered by the tools service"):
                    self.tenant_added()
                with self.step("a request from the host's producer CLI, as the tenant"):
                    self.request_from_the_host()
                with self.step("a request through the gateway with the tenant's API key (openai)"):
                    self.request_through_the_gateway()
                with self.step("kill -9 of the worker mid-generation"):
                    victim = self.kill_mid_generation()
                with self.step("the killed worker started again, healthy"):
                    self.podman("start", victim)
                    self.healthy([victim])
                with self.step("a worker that crashes is restarted by its restart policy"):
                    self.crash_restarts()
                with self.step("Prometheus scrapes every worker"):
                    self.prometheus_targets()
                with self.step("the cluster profile: six nodes formed, a tenant, a request through its gateway",
                               "cluster_s"):
                    self.cluster()
                with self.step("hardening of the running containers"):
                    self.hardening()
                with self.step("down, then up: Redis keeps its data"):
                    self.compose("down")
                    self.up("up again, until every healthcheck passes", "healthy_again_s")
                    self.data_kept()
                with self.step("GPU profiles render"):
                    self.gpu_profiles()
                if not self.args.skip_gpu_branch:
                    with self.step("the Dockerfile's branch for a base with its own torch", "gpu_branch_build_s"):
                        self.gpu_branch()
            finally:
                if self.args.keep:
                    self.console.print(f"left running; its Redis passwords are in {self.secrets}: "
                                       f"`podman-compose -p {PROJECT} down -v` when done")
                else:
                    self.teardown()

    def teardown(self) -> None:
        """`down -v`, and whatever podman-compose 1.6's down leaves of the project (a container a
        restart policy started again meanwhile, volumes, the pod, the network)."""
        self.compose("down", "-v", check=False)
        project = f"label=io.podman.compose.project={PROJECT}"
        for kind in ("container", "volume"):
            left = self.podman(kind, "ls", "-q", "--filter", project, *(["-a"] if kind == "container" else []),
                               check=False).stdout.split()
            if left:
                self.podman(kind, "rm", "-f", *left, check=False)
        self.podman("pod", "rm", "-f", "--ignore", f"pod_{PROJECT}", check=False)
        self.podman("network", "rm", "-f", f"{PROJECT}_default", check=False)

    def preflight(self) -> None:
        missing = [name for name, found in (
            ("podman", shutil.which("podman")), ("podman-compose", self.podman_compose),
            ("catatonit (compose's `init: true`)", Path("/usr/libexec/podman/catatonit").exists()),
            ("debootstrap", shutil.which("debootstrap"))) if not found]
        if missing:
            raise SmokeError(f"{', '.join(missing)} not found: apt-get install podman runc catatonit debootstrap "
                             "golang-github-containernetworking-plugin-dnsname; pip install -e '.[dev]'")
        if os.geteuid() != 0:
            raise SmokeError("run it as root: the stack needs rootful podman (networks with DNS, published ports)")
        self.secrets.mkdir(mode=0o700)
        for user, password in self.passwords.items():
            self.secret(user).write_text(password + "\n")
            self.secret(user).chmod(0o644)  # read by the containers' own users (redis, 10001)
        (self.secrets / "tenants").mkdir(mode=0o700)
        os.chown(self.secrets / "tenants", *map(int, CONTAINER_USER.split(":")))  # the tools service writes there

    def secret(self, user: str) -> Path:
        return self.secrets / f"redis_{user}_password"

    @contextlib.contextmanager
    def step(self, what: str, figure: str | None = None) -> Iterator[None]:
        started = time.monotonic()
        with self.console.status(what):
            yield
        took = time.monotonic() - started
        if figure is not None:
            self.figures[figure] = round(took, 1)
        self.console.print(f"[green]✓[/] {what} ({took:.1f} s)")

    # --- images ------------------------------------------------------------------------
    @contextlib.contextmanager
    def package_index(self) -> Iterator[str]:
        """A PEP 503 index of the pinned torch and what it needs, served on 127.0.0.1: the build's
        TORCH_INDEX_URL (download.pytorch.org is out of reach here)."""
        wheels = self.scratch / "wheels"
        self.quiet([sys.executable, "-m", "pip", "download", "--quiet", f"torch=={torch_version()}", "--dest",
                    str(wheels)])
        simple = self.scratch / "index" / "simple"
        for wheel in wheels.iterdir():
            project = simple / re.sub(r"[-_.]+", "-", wheel.name.split("-")[0]).lower()
            project.mkdir(parents=True, exist_ok=True)
            shutil.move(wheel, project / wheel.name)
        handler = functools.partial(QuietFiles, directory=str(simple.parent))
        server = http.server.ThreadingHTTPServer(("127.0.0.1", self.index_port), handler)
        threading.Thread(target=server.serve_forever, name="package-index", daemon=True).start()
        try:
            yield f"http://127.0.0.1:{server.server_port}/simple/"
        finally:
            server.shutdown()
            server.server_close()

    def standins(self, index_url: str) -> None:
        if self.podman("image", "exists", DEBIAN, check=False).returncode != 0:
            rootfs = self.scratch / "rootfs"
            self.quiet(["debootstrap", "--variant=minbase", "bookworm", str(rootfs), "http://deb.debian.org/debian"])
            tar = subprocess.Popen(["tar", "-C", str(rootfs), "-c", "."], stdout=subprocess.PIPE)
            self.quiet(["podman", "import", "-", DEBIAN], stdin=tar.stdout)
            tar.wait()
        context = self.scratch / "standins"
        context.mkdir()
        shutil.copy(HERE / "standins.Containerfile", context / "Containerfile")
        shutil.copy(ssl.get_default_verify_paths().cafile or "/etc/ssl/certs/ca-certificates.crt",
                    context / "machine-ca-certificates.crt")
        targets = ["python", "redis", "prometheus"] + ([] if self.args.skip_gpu_branch else ["python-with-torch"])
        for target in targets:
            self.quiet(["podman", "build", "--network", "host", "--target", target, "--build-arg",
                        f"TORCH_INDEX_URL={index_url}", "--build-arg", f"TORCH_VERSION={torch_version()}",
                        "-t", f"{STANDIN}/{target}", str(context)])

    def gateway_image_is_light(self) -> None:
        """The gateway's image (also the tools service's) has no torch and no worker, and is a
        fraction of the worker's size."""
        image = "localhost/streambatch-gateway:latest"
        found = self.podman("run", "--rm", "--entrypoint", "python", image, "-c",
                            "import importlib.util as u; print([m for m in ('torch', 'worker', 'producer.gateway') "
                            "if u.find_spec(m)])").stdout.strip()
        if found != "['producer.gateway']":
            raise SmokeError(f"the gateway image holds {found}, not only the gateway")
        sizes = {name: int(self.podman("image", "inspect", "--format", "{{.Size}}", name).stdout)
                 for name in (image, "localhost/streambatch-worker:cpu")}
        self.figures["image_mb"] = {name.split("/")[-1]: round(size / 2**20) for name, size in sizes.items()}
        self.console.print(f"  image sizes: {self.figures['image_mb']}")

    def gpu_branch(self) -> None:
        """The CUDA base (pytorch/pytorch) brings its torch, and the Dockerfile then installs none:
        that branch, on a stand-in base with torch inside, up to a worker that loads its model."""
        image = "localhost/streambatch-worker:torch-in-base"
        output = self.quiet(["podman", "build", "--network", "host", "--build-arg",
                             f"BASE_IMAGE={STANDIN}/python-with-torch", "-t", image, str(ROOT)])
        # "STEP 5/9: ...", or "[1/2] STEP 5/14: ..." in a build of more than one stage
        steps = [line for line in output.splitlines() if re.match(r"(\[\d+/\d+\] )?STEP \d", line)]
        torch_step = next(index for index, line in enumerate(steps) if "import torch" in line)
        installed = output.split(steps[torch_step])[1].split(steps[torch_step + 1])[0]
        if "Successfully installed" in installed:
            raise SmokeError("the Dockerfile installed torch on a base that has it")
        loaded = self.podman("run", "--rm", "--entrypoint", "python", image, "-c",
                             "from worker.engine.models import load_model; load_model('smollm2-135m'); print('loaded')")
        if "loaded" not in loaded.stdout:
            raise SmokeError(f"the image on a torch base does not load its model: {loaded.stdout[-500:]}")
        self.podman("rmi", image, check=False)

    # --- the stack ---------------------------------------------------------------------
    def up(self, what: str, figure: str) -> None:
        with self.step(what, figure):
            self.compose("up", "-d", "--scale", f"worker-cpu={self.args.workers}")
            self.healthy([name for name in self.containers() if self.inspect(name)["Config"].get("Healthcheck")])
        workers = self.workers()
        if len(workers) != self.args.workers:
            raise SmokeError(f"{len(workers)} worker containers, not {self.args.workers}")

    def healthy(self, names: list[str], timeout: float = 600) -> None:
        """Until each container's healthcheck passes (run here: no systemd schedules them)."""
        deadline = time.monotonic() + timeout
        while not all(self.podman("healthcheck", "run", name, check=False).returncode == 0 for name in names):
            if time.monotonic() > deadline:
                raise SmokeError(f"not healthy after {timeout:.0f} s: {self.podman('ps', '-a').stdout}")
            time.sleep(2)

    def crash_restarts(self) -> None:
        """`podman kill` is an operator's stop, which no restart policy undoes; a worker process
        that dies (the OOM killer, a crash, its own exit on a stalled loop) is started again."""
        name = self.workers()[0]
        init = self.inspect(name)["State"]["Pid"]
        worker = next(int(pid) for pid in Path(f"/proc/{init}/task/{init}/children").read_text().split())
        os.kill(worker, 9)
        wait_until(lambda: self.inspect(name)["RestartCount"] >= 1 and self.inspect(name)["State"]["Running"], 60,
                   f"{name} was not restarted after its process died")
        self.healthy([name])
        self.figures["restarted_after_crash"] = name

    def tenant_added(self) -> None:
        """`streambatch tenant add` in the tools container, as the operator: the tenant's ACL user,
        its password in the file named (on the host, 0600), its API key printed once."""
        added = self.compose("--profile", "tools", "run", "--rm", "tools", "tenant", "add", TENANT,
                             "--password-file", f"/tenants/{TENANT}.password")
        if not added.stdout.strip().startswith(API_KEY_PREFIX) or \
                self.tenant_password_file.stat().st_mode & 0o777 != 0o600:
            raise SmokeError(f"tenant add printed no API key or left no private password file: {added.stdout[-500:]}")
        if any(password in added.stdout + added.stderr for password in self.passwords.values()):
            raise SmokeError("tenant add printed a Redis password")
        self.tenant_password = read_password(str(self.tenant_password_file))
        self.api_key = added.stdout.strip().splitlines()[0]  # `run` may pass the lines of stderr on too
        registered = self.redis().hget(KEYS.tenants, TENANT)
        self.figures["tenant"] = {"name": TENANT, "registered": registered is not None, "api_key_printed_once": True}

    def request_from_the_host(self) -> None:
        out = subprocess.run(
            [sys.executable, "-m", "producer", "--redis-url", self.tenant_url, "--redis-password-file",
             str(self.tenant_password_file), "--tenant", TENANT, "submit", "Name three colours.", "--chat",
             "--stream", "--max-tokens", "24", "--temperature", "0", "--id", f"smoke-hello-{self.run_id}"],
            cwd=ROOT, capture_output=True, text=True, timeout=300)
        if out.returncode != 0 or not out.stdout.strip():
            raise SmokeError(f"the producer CLI got no tokens (status {out.returncode}): {out.stderr[-1000:]}")
        self.figures["request_text"] = out.stdout.strip()
        self.console.print(f"  tokens: {out.stdout.strip()!r}")

    def request_through_the_gateway(self) -> None:
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{self.gateway_port}/v1", api_key=self.api_key,
                               max_retries=0)
        try:
            reply = client.chat.completions.create(model="smollm2-135m", max_tokens=16, temperature=0,
                                                   messages=[{"role": "user", "content": "Name three colours."}])
        except openai.APIError as error:
            raise SmokeError(f"the gateway did not answer: {error!r}") from None
        if not reply.choices[0].message.content or not self.redis().exists(KEYS.of(TENANT).replay(reply.id)):
            raise SmokeError(f"the gateway's answer is empty or not the tenant's: {reply}")
        try:
            openai.OpenAI(base_url=client.base_url, api_key="sbk-wrong", max_retries=0).models.list()
        except openai.AuthenticationError:
            pass
        else:
            raise SmokeError("the gateway served a wrong API key")
        self.figures["gateway_text"] = reply.choices[0].message.content
        self.console.print(f"  the gateway answered {reply.choices[0].message.content!r}; a wrong key got 401")

    def cluster(self) -> None:
        """compose's cluster profile: six Redis nodes formed by redis-cluster-init (its replicas
        linked as `replicator`), a tenant registered on every node by the tools service in cluster
        mode, and a request through gateway-cluster with its key, answered by worker-cluster."""
        # In stages, as compose's depends_on orders them (podman-compose cannot wait on a condition)
        nodes = [f"redis-node-{i}" for i in range(6)]
        self.compose("--profile", "cluster", "up", "-d", "--no-deps", *nodes)
        self.healthy(self.of_services(nodes))
        self.compose("--profile", "cluster", "up", "-d", "--no-deps", "redis-cluster-init")
        init = self.of_services(["redis-cluster-init"], running=False)
        status = self.podman("wait", *init).stdout.split()
        formed = self.podman("logs", *init)
        if status != ["0"]:
            raise SmokeError(f"redis-cluster-init exited {status}: {formed.stdout[-500:]}{formed.stderr[-500:]}")
        self.compose("--profile", "cluster", "up", "-d", "--no-deps", "worker-cluster", "gateway-cluster")
        self.healthy(self.of_services(["worker-cluster", "gateway-cluster"]))
        added = self.compose("--profile", "tools", "run", "--rm", "-e", "STREAMBATCH_REDIS_URL="
                             "redis://operator@redis-node-0:6379/0", "-e", "STREAMBATCH_REDIS_CLUSTER=1", "tools",
                             "tenant", "add", f"{TENANT}-cluster", "--password-file", f"/tenants/{TENANT}-cluster.password")
        api_key = next((line for line in added.stdout.split() if line.startswith(API_KEY_PREFIX)), "")
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{self.cluster_gateway_port}/v1", api_key=api_key,
                               max_retries=0)
        try:
            reply = client.chat.completions.create(model="smollm2-135m", max_tokens=16, temperature=0,
                                                   messages=[{"role": "user", "content": "Name three colours."}])
        except openai.APIError as error:
            raise SmokeError(f"the cluster's gateway did not answer: {error!r}") from None
        if reply.choices[0].message.content != self.figures["gateway_text"]:
            raise SmokeError(f"the cluster's answer differs from the single node's: {reply}")
        linked = sum("master_link_status:up" in self.podman("exec", name, "sh", "-c",
                                                             'REDISCLI_AUTH="$(cat /run/secrets/redis_operator_password)" '
                                                             "redis-cli --user operator info replication").stdout
                     for name in self.containers() if "redis-node" in name)
        if linked != 3:
            raise SmokeError(f"{linked} replicas linked to their masters, not 3")
        said = re.sub(r"\x1b\[[0-9;]*m", "", formed.stdout).strip().splitlines()[-1]  # redis-cli's colours
        self.figures["cluster"] = {"formed": said, "replicas_linked": linked, "answer": reply.choices[0].message.content}
        self.console.print(f"  {said}; 3 replicas linked as replicator; the cluster's gateway gave the single "
                           "node's answer")

    def kill_mid_generation(self) -> str:
        """-> the container killed."""
        params = SamplingParams(max_tokens=300, temperature=0.0, ignore_eos=True)
        messages = [{"role": "user", "content": "Tell me a long story about a lighthouse."}]
        with Producer(self.tenant_url, password=self.tenant_password, tenant=TENANT) as producer:
            events: list = []
            handle = producer.submit(messages=messages, params=params, request_id=f"smoke-killed-{self.run_id}")
            streaming = threading.Thread(target=lambda: events.extend(handle.stream(timeout=300)), daemon=True)
            streaming.start()
            wait_until(lambda: sum(isinstance(event, TokenEvent) for event in events) >= 3, 120,
                       "the long request did not start")
            victim = self.holder(handle.id)
            killed_at = time.monotonic()
            self.podman("kill", "-s", "KILL", victim)
            streaming.join(300)
            if streaming.is_alive() or not events or not isinstance(events[-1], DoneEvent):
                raise SmokeError(f"the killed worker's request did not finish: {events[-1:]}")
            finished_in = time.monotonic() - killed_at
            undisturbed = producer.submit(messages=messages, params=params,
                                          request_id=f"smoke-undisturbed-{self.run_id}").result(timeout=300)
        seqs = [event.seq for event in events]
        attempts = sorted({event.attempt for event in events})
        tokens = [token for event in events if isinstance(event, TokenEvent) for token in event.ids]
        if seqs != list(range(len(events))) or attempts != [1, 2]:
            raise SmokeError(f"seqs {seqs[:10]}... attempts {attempts}: not each once, or not resumed")
        if tokens != undisturbed.token_ids:
            raise SmokeError("the resumed request's tokens differ from an undisturbed run's")
        self.figures["kill"] = {"container": victim, "events": len(events), "tokens": len(tokens),
                                "attempts": attempts, "finished_after_kill_s": round(finished_in, 1),
                                "same_tokens_as_undisturbed": True}
        self.console.print(f"  killed {victim}; {len(events)} events seq 0..{len(events) - 1} once each, attempts "
                           f"{attempts}, finished {finished_in:.1f} s after the kill, tokens as an undisturbed run")
        return victim

    def holder(self, request_id: str) -> str:
        """The container whose worker holds the request's entry."""
        client = self.redis()
        for lane in ("fast", "normal"):
            stream = KEYS.of(TENANT).requests(lane)
            entries = {entry_id: fields for entry_id, fields in client.xrange(stream)}
            for pending in client.xpending_range(stream, GROUP, "-", "+", 100):
                fields = entries.get(pending["message_id"])
                if fields and usable_id(fields[FIELD]) == request_id:
                    beat = json.loads(client.get(KEYS.worker(worker_of(pending["consumer"].decode()))))
                    return next(name for name in self.workers() if self.inspect(name)["Config"]["Hostname"]
                                == beat["host"])
        raise SmokeError(f"no worker holds {request_id}")

    def prometheus_targets(self) -> None:
        def targets() -> list[dict]:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.prometheus_port}/api/v1/targets", timeout=5) as reply:
                return [target for target in json.load(reply)["data"]["activeTargets"]
                        if target["labels"]["job"] == "streambatch-worker"]

        def up() -> list[dict]:
            return [target for target in targets() if target["health"] == "up"]

        try:
            wait_until(lambda: len(up()) == self.args.workers, 120, "")
        except SmokeError:
            raise SmokeError(f"Prometheus does not see {self.args.workers} workers up: {targets()}") from None
        self.figures["prometheus_targets_up"] = sorted(target["labels"]["instance"] for target in up())
        self.console.print(f"  targets up: {self.figures['prometheus_targets_up']}")

    def hardening(self) -> None:
        found = {}
        for name in self.containers():
            container = self.inspect(name)
            host, config = container["HostConfig"], container["Config"]
            service = config["Labels"]["com.docker.compose.service"]
            arguments = self.podman("top", name, "args").stdout
            # every process's effective and bounding capability sets, as the kernel has them
            capabilities = set(self.podman("exec", name, "sh", "-c",
                                           r"grep -h '^Cap\(Eff\|Bnd\)' /proc/[0-9]*/status").stdout.split()[1::2])
            problems = [why for why, bad in (
                ("a password is in its configuration (environment, command, labels)",
                 any(password in json.dumps(container) for password in self.passwords.values())),
                ("a password is in a process's arguments",
                 any(password in arguments for password in self.passwords.values())),
                (f"pid limit {host.get('PidsLimit')}, memory limit {host.get('Memory')}",
                 not 0 < (host.get("PidsLimit") or 0) <= 512 or not host.get("Memory")),
                (f"capabilities left: {capabilities}", capabilities != {"0000000000000000"}),
                ("no no-new-privileges",
                 not any("no-new-privileges" in option for option in host.get("SecurityOpt") or [])),
                ("root filesystem writable", not host["ReadonlyRootfs"]),
            ) if bad]
            user = self.podman("exec", name, "id", "-u").stdout.strip()
            if service == "worker-cpu" and (config["User"] != CONTAINER_USER or user != "10001"):
                problems.append(f"runs as {config['User']!r} (uid {user}), not {CONTAINER_USER}")
            if user == "0":
                problems.append("runs as root")
            if self.podman("exec", name, "sh", "-c", "touch /written-here", check=False).returncode == 0:
                problems.append("could write to its root filesystem")
            compilers = self.podman("exec", name, "sh", "-c", "command -v gcc g++ cc c++ clang || true").stdout
            if service in ("worker-cpu", "gateway") and compilers.strip():
                problems.append(f"a compiler in the image: {compilers.split()}")
            if problems:
                raise SmokeError(f"{name}: {'; '.join(problems)}")
            found[name] = {"service": service, "uid": user, "read_only": True, "capabilities": []}
        try:
            redis.Redis(port=self.redis_port).ping()
        except redis.AuthenticationError:
            pass
        except redis.ResponseError as error:
            if "NOAUTH" not in str(error):
                raise
        else:
            raise SmokeError("Redis answered a client without its password")
        self.figures["hardening"] = found
        self.figures["tenant_refused"] = self.tenant_refusals()
        self.console.print(f"  {len(found)} containers: no capabilities, no-new-privileges, read-only, not root, "
                           "pid and memory limits, no compiler, no password in inspect or argv; Redis refuses a "
                           f"client without a password, and the tenant {len(self.figures['tenant_refused'])} "
                           "commands outside its role")

    def tenant_refusals(self) -> list[str]:
        """What the tenant's ACL user must not do on the running Redis (tests/worker/test_acl.py has
        the whole list): each must be refused."""
        tenant = redis.Redis.from_url(self.tenant_url, password=self.tenant_password)
        attempts = {
            "read the registry": lambda: tenant.hgetall(KEYS.tenants),
            "read a worker's heartbeat": lambda: tenant.get(KEYS.worker("any")),
            "read the default tenant's queue": lambda: tenant.xrange(KEYS.requests("normal")),
            "FLUSHALL": tenant.flushall,
            "CONFIG GET": lambda: tenant.config_get("*"),
            "KEYS": lambda: tenant.keys("*"),
            "DEL its own lane stream": lambda: tenant.delete(KEYS.of(TENANT).requests("normal")),
        }
        refused = []
        for what, attempt in attempts.items():
            try:
                attempt()
            except redis.exceptions.NoPermissionError:
                refused.append(what)
                continue
            raise SmokeError(f"the tenant's ACL user was allowed to {what}")
        return refused

    def data_kept(self) -> None:
        replay = self.redis().xrange(KEYS.of(TENANT).replay(f"smoke-hello-{self.run_id}"))
        events = [decode_event(fields[FIELD]) for _, fields in replay]
        if not events or not isinstance(events[-1], DoneEvent):
            raise SmokeError("step 5's request is gone from Redis after down and up")
        try:
            redis.Redis.from_url(self.tenant_url, password=self.tenant_password).ping()
        except redis.AuthenticationError:
            raise SmokeError("the tenant's ACL user did not outlive down and up") from None
        self.figures["events_kept_across_down_up"] = len(events)

    def gpu_profiles(self) -> None:
        rendered = yaml.safe_load(self.call([self.podman_compose, "-f", str(ROOT / "compose.yaml"), "--profile", "gpu",
                                            "--profile", "multi-gpu", "config"]).stdout)["services"]
        devices = {name: service["deploy"]["resources"]["reservations"]["devices"]
                   for name, service in rendered.items() if name.startswith("worker") and name != "worker-cpu"}
        ids = [device.get("device_ids") for name, listed in devices.items() if name != "worker" for device in listed]
        if devices.get("worker") != [{"driver": "nvidia", "count": 1, "capabilities": ["gpu"]}] or \
                sorted(map(tuple, ids)) != [("0",), ("1",)]:
            raise SmokeError(f"the GPU profiles render other devices: {devices}")
        self.figures["gpu_devices"] = devices

    # --- podman ------------------------------------------------------------------------
    def compose(self, *args: str, check: bool = True) -> subprocess.CompletedProcess:
        return self.call([self.podman_compose, "-p", PROJECT, "-f", str(ROOT / "compose.yaml"), "-f",
                         str(HERE / "smoke.override.yaml"), "--profile", "cpu", *args], check=check)

    def podman(self, *args: str, check: bool = True) -> subprocess.CompletedProcess:
        return self.call(["podman", *args], check=check)

    def of_services(self, services: list[str], running: bool = True) -> list[str]:
        """The containers of these compose services (with `running=False`, those that ended too)."""
        listed = self.podman("ps", *([] if running else ["-a"]), "--filter",
                             f"label=io.podman.compose.project={PROJECT}", "--format",
                             "{{.Names}} {{index .Labels \"com.docker.compose.service\"}}").stdout.splitlines()
        return [line.split()[0] for line in listed if line.split()[1:] and line.split()[1] in services]

    def containers(self) -> list[str]:
        return self.podman("ps", "--filter", f"label=io.podman.compose.project={PROJECT}",
                           "--format", "{{.Names}}").stdout.split()

    def workers(self) -> list[str]:
        return [name for name in self.containers()
                if self.inspect(name)["Config"]["Labels"]["com.docker.compose.service"] == "worker-cpu"]

    def inspect(self, name: str) -> dict:
        return json.loads(self.podman("inspect", name).stdout)[0]

    def redis(self) -> redis.Redis:
        return redis.Redis.from_url(self.redis_url, password=self.password)

    def call(self, command: list[str], check: bool = True, **options) -> subprocess.CompletedProcess:
        done = subprocess.run(command, cwd=ROOT, env=self.environ, capture_output=True, text=True, **options)
        if check and done.returncode != 0:
            raise SmokeError(f"`{' '.join(command)}` exited with status {done.returncode}: "
                             f"{(done.stdout + done.stderr)[-2000:]}")
        return done

    def quiet(self, command: list[str], **options) -> str:
        """Run a long command, its output kept for the error (and returned)."""
        return self.call(command, **options).stdout


class QuietFiles(http.server.SimpleHTTPRequestHandler):
    def log_message(self, format: str, *args: object) -> None:
        """No line per request."""


def port_or_free(port: int) -> int:
    """`port` if nothing listens on it (127.0.0.1), else a free one."""
    with socket.socket() as probe:
        try:
            probe.bind(("127.0.0.1", port))
        except OSError:
            return free_port()
    return port


def torch_version() -> str:
    """The torch the Dockerfile pins."""
    return re.search(r"^ARG TORCH_VERSION=(\S+)", (ROOT / "Dockerfile").read_text(), re.MULTILINE).group(1)


def wait_until(condition, timeout: float, message: str) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            if condition():
                return
        except (OSError, redis.RedisError, ValueError):
            pass  # not up yet
        if time.monotonic() > deadline:
            raise SmokeError(message)
        time.sleep(1)


if __name__ == "__main__":
    sys.exit(main())
