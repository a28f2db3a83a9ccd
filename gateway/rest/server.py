"""The REST app under uvicorn, inside the gateway's event loop."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket

import uvicorn

from gateway.core import GatewayCore
from gateway.models import ModelSet
from gateway.rest.app import build_app

log = logging.getLogger(__name__)


class RestServer:
    """``start`` binds (port 0: any free port, then ``port`` says which) and serves."""

    def __init__(self, served: GatewayCore | ModelSet, host: str, port: int):
        self.served, self.host, self.port = served, host, port
        self._server: uvicorn.Server | None = None
        self._task: asyncio.Task | None = None

    async def start(self) -> None:
        family = socket.AF_INET6 if ":" in self.host else socket.AF_INET
        # proto=IPPROTO_TCP: asyncio turns Nagle off (TCP_NODELAY) only on sockets that
        # say so; with Nagle on, a response's second write waits for the client's delayed
        # ACK (~40 ms on every request).
        sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.bind((self.host, self.port))
        self.port = sock.getsockname()[1]
        # httptools: the C parser (h11, uvicorn's pure-Python fallback, costs ~1 ms a
        # request here); no proxy-header rewriting: the gateway is the edge.
        config = uvicorn.Config(
            build_app(self.served),
            http="httptools",
            log_level="warning",
            lifespan="off",
            access_log=False,
            proxy_headers=False,
            server_header=False,
            timeout_graceful_shutdown=5,
        )
        self._server = uvicorn.Server(config)
        self._task = asyncio.create_task(self._server.serve(sockets=[sock]))
        while not self._server.started and not self._task.done():
            await asyncio.sleep(0.01)
        if self._task.done():
            self._task.result()  # raises what stopped it

    async def stop(self) -> None:
        """Stop taking connections, let open responses finish (bounded); safe twice."""
        if self._server is None or self._task is None:
            return
        self._server.should_exit = True
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await asyncio.wait_for(self._task, timeout=10)
        self._server = None
