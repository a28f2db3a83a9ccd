"""A service on the real skeleton whose work finishes only when the test says so.

Work arrives on ``test.work.<id>`` (per instance: refused while draining) and waits until
a message on ``test.release.<id>``; so a test holds work in flight across a drain for as
long as it needs, without sleeping. ``python -m tests.helpers.held_service NATS_URL ID
GRACE_S`` runs one as a process under ``serve_until_signal``, like ``epd serve``.
"""

from __future__ import annotations

import asyncio
import logging
import sys

from protos.epd_pb import bus_pb2
from services.bus import subjects
from services.bus.handlers import Incoming
from services.config import ServiceConfig
from services.runtime import serve_until_signal
from services.service import Service

# Heartbeats go out as an encoder's; a model name no real encoder has keeps routers away.
MODEL = "held-test"


def work_subject(instance_id: str) -> str:
    return f"test.work.{instance_id}"


def release_subject(instance_id: str) -> str:
    return f"test.release.{instance_id}"


class HeldService(Service):
    """Each work request is answered (``image_hash="done"``) once released."""

    role = subjects.ROLE_ENCODE

    def __init__(self, config: ServiceConfig) -> None:
        super().__init__(config)
        self.model_fingerprint = MODEL
        self.released = asyncio.Event()

    async def register(self) -> None:
        await self.serve_work(work_subject(self.instance_id), self._on_work, bus_pb2.EncodeReply)
        await self.bus.subscribe(release_subject(self.instance_id), self._on_release)

    async def _on_work(self, msg: Incoming) -> None:
        await self.released.wait()
        await msg.respond(bus_pb2.EncodeReply(image_hash="done"))

    async def _on_release(self, msg: Incoming) -> None:
        self.released.set()


def config(nats_url: str, instance_id: str, grace_s: float) -> ServiceConfig:
    return ServiceConfig(
        nats_url=nats_url, instance_id=instance_id, heartbeat_s=0.1, shutdown_grace_s=grace_s
    )


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, stream=sys.stderr)
    url, iid, grace = sys.argv[1], sys.argv[2], float(sys.argv[3])
    asyncio.run(serve_until_signal(HeldService(config(url, iid, grace))))
