"""Fleet workers as real processes (``epd serve <role>``), for tests that kill them.

The gateway stays in the test's process (its router and counters can be inspected);
encoder, prefill and decode instances run as children that ``kill()`` ends with
SIGKILL: no draining heartbeat, no goodbye, the connection just drops.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


@dataclass
class Worker:
    role: str
    instance_id: str
    proc: subprocess.Popen
    log: Path

    def kill(self) -> None:
        """kill -9."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(timeout=30)

    def log_tail(self, chars: int = 3000) -> str:
        return self.log.read_text(errors="replace")[-chars:] if self.log.exists() else ""


@dataclass
class ProcessFleet:
    """Spawns workers of one model on one NATS/Redis pair; ``stop()`` kills them all."""

    model: str
    nats_url: str
    redis_url: str
    log_dir: Path
    env: dict[str, str] = field(default_factory=dict)
    workers: list[Worker] = field(default_factory=list)

    def spawn(self, role: str, instance_id: str, **env: str) -> Worker:
        full_env = {
            **os.environ,
            "EPD_MODEL": self.model,
            "EPD_HEARTBEAT_S": "0.2",
            "EPD_INSTANCE_TTL_S": "1.0",
            "EPD_SHUTDOWN_GRACE_S": "5",
            **self.env,
            **env,
        }
        argv = [
            sys.executable,
            "-m",
            "launch.cli",
            "serve",
            role,
            "--nats-url",
            self.nats_url,
            "--redis-url",
            self.redis_url,
            "--instance-id",
            instance_id,
        ]
        log = self.log_dir / f"{instance_id}.log"
        with open(log, "wb") as out:
            proc = subprocess.Popen(
                argv, cwd=ROOT, env=full_env, stdout=out, stderr=subprocess.STDOUT
            )
        worker = Worker(role, instance_id, proc, log)
        self.workers.append(worker)
        return worker

    def stop(self) -> None:
        for w in self.workers:
            if w.proc.poll() is None:
                w.proc.send_signal(signal.SIGTERM)
        for w in self.workers:
            try:
                w.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                w.kill()


def text_fleet_env(ckpt: Path, num_kv_blocks: int = 512) -> dict[str, str]:
    """Worker settings for a text checkpoint (no encoder needed)."""
    return {"EPD_MODEL": str(ckpt), "EPD_NUM_KV_BLOCKS": str(num_kv_blocks)}


def fail_message(fleet: ProcessFleet) -> str:
    return "\n".join(f"--- {w.instance_id}\n{w.log_tail()}" for w in fleet.workers)


async def kill_the_holder(workers: list[Worker], role: str, gateway, send):
    """Freeze ``workers`` (SIGSTOP: whichever gets the work holds it without a word),
    start ``send()``, kill -9 the one the gateway's router shows holding it, resume the
    others; returns the started call. ``role``: the router's role name ("encode", ...)."""
    backend = gateway.core.backend
    for w in workers:
        w.proc.send_signal(signal.SIGSTOP)
    try:
        call = asyncio.ensure_future(send())
        await backend.registry.wait_for(
            lambda: any(backend.router.inflight(role, w.instance_id) for w in workers), 10
        )
        holding = [w for w in workers if backend.router.inflight(role, w.instance_id)]
        holding[0].kill()
    finally:
        for w in workers:
            if w.proc.poll() is None:
                w.proc.send_signal(signal.SIGCONT)
    return call
