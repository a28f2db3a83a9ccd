"""The life of a service process: start, serve until a signal, ordered shutdown."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
from typing import Protocol

from services.bus.connection import Bus, BusConfig
from services.config import ServiceConfig

log = logging.getLogger(__name__)


class Service(Protocol):
    async def start(self) -> None: ...
    async def stop(self) -> None: ...


async def connect_bus(config: ServiceConfig, name: str) -> Bus:
    """The process's bus, with the credentials and TLS of ``config`` (URL userinfo,
    creds / nkey seed file, TLS files): every service connects through here."""
    servers = tuple(u.strip() for u in config.nats_url.split(",") if u.strip())
    return await Bus.connect(BusConfig(servers=servers, name=name, auth=config.nats_auth()))


async def serve_until_signal(service: Service) -> None:
    """start -> wait for SIGINT/SIGTERM -> stop (in ``finally``, so always)."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(NotImplementedError):
            loop.add_signal_handler(sig, stop.set)
    try:
        await service.start()
        await stop.wait()
        log.info("shutting down")
    finally:
        await service.stop()
