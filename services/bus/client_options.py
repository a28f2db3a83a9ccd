"""nats-py connection options for a ``BusConfig``: reconnect policy and logging callbacks."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from nats.aio.client import Client

if TYPE_CHECKING:
    from services.bus.connection import BusConfig

logger = logging.getLogger("services.bus.connection")


def connect_options(config: BusConfig, nc: Client) -> dict[str, object]:
    async def on_error(exc: Exception) -> None:
        logger.warning("nats error name=%s: %r", config.name, exc)

    async def on_disconnect() -> None:
        if not (nc.is_closed or nc.is_draining):
            logger.warning("nats disconnected name=%s", config.name)

    async def on_reconnect() -> None:
        logger.info("nats reconnected name=%s", config.name)

    return {
        "servers": list(config.servers),
        "name": config.name,
        "connect_timeout": config.connect_timeout_s,
        "reconnect_time_wait": config.reconnect_wait_s,
        "max_reconnect_attempts": config.max_reconnect_attempts,
        "ping_interval": config.ping_interval_s,
        "drain_timeout": config.drain_timeout_s,
        "allow_reconnect": True,
        "error_cb": on_error,
        "disconnected_cb": on_disconnect,
        "reconnected_cb": on_reconnect,
    }
