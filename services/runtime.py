"""The life of a service process: start, serve until a signal, drain, ordered shutdown.

The first SIGTERM / SIGINT starts the graceful drain (services/service.py); a second one
exits at once, without waiting for in-flight work (an operator who means it).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import sys
from collections.abc import Callable, Coroutine
from typing import Any, Protocol, TypeVar

from services.bus.connection import Bus, BusConfig
from services.config import ServiceConfig

log = logging.getLogger(__name__)
T = TypeVar("T")


class Service(Protocol):
    """What serve_until_signal drives (services/service.py's Service is one)."""

    async def start(self) -> None: ...
    async def stop(self) -> None: ...


async def connect_bus(config: ServiceConfig, name: str) -> Bus:
    """The process's bus, with the credentials and TLS of ``config`` (URL userinfo,
    creds / nkey seed file, TLS files): every service connects through here."""
    servers = tuple(u.strip() for u in config.nats_url.split(",") if u.strip())
    return await Bus.connect(BusConfig(servers=servers, name=name, auth=config.nats_auth()))


def run(main: Coroutine[Any, Any, T], event_loop: str = "auto") -> T:
    """``asyncio.run(main)`` on the loop ``event_loop`` names (ServiceConfig.event_loop).

    Why uvloop: a service's loop is one core's worth of Python beside the engine (in
    ``serve all``, the same core): every streamed token is a few callbacks, a socket write
    and a NATS or SSE frame. uvloop runs those parts in C (libuv). asyncio's own loop is the
    fallback where uvloop is not installed (in-process tests run on it too).
    """
    factory = None
    if event_loop in ("auto", "uvloop"):
        try:
            import uvloop
        except ImportError:
            if event_loop == "uvloop":
                raise ValueError("event_loop 'uvloop': uvloop is not installed") from None
        else:
            factory = uvloop.new_event_loop
    with asyncio.Runner(loop_factory=factory) as runner:
        return runner.run(main)


async def serve_until_signal(service: Service) -> None:
    """start -> wait for SIGINT/SIGTERM -> stop (in ``finally``, so always); a second
    signal while stopping exits the process at once."""
    stop = asyncio.Event()

    def on_signal(sig: signal.Signals) -> None:
        if stop.is_set():
            log.warning("second %s: exiting now, in-flight work is dropped", sig.name)
            _exit_now(128 + sig)
        log.info("%s: draining (send it again to exit at once)", sig.name)
        stop.set()

    _on_signals(on_signal)
    try:
        await service.start()
        # Again: uvicorn (the gateway's REST server) takes SIGINT/SIGTERM over while it
        # starts and raises the signal anew when it stops, which would read as a second one.
        _on_signals(on_signal)
        await stop.wait()
    finally:
        await service.stop()


def _on_signals(handler: Callable[[signal.Signals], None]) -> None:
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(NotImplementedError):
            loop.add_signal_handler(sig, handler, sig)


def _exit_now(code: int) -> None:
    """Leave without unwinding: ``finally`` blocks would start the drain again."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
