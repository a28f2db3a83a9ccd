"""Start-up and hot reload of the router config.

``open_router`` reads and validates the file (a bad file stops the gateway with the
error naming the field). ``RouterReloader`` then polls the file's mtime and size; a
changed file is compiled (its examples embedded) and swapped in whole, and a bad one is
logged and counted while the old config keeps serving. The same loop retries the
embeddings of a config loaded while the cache service was not answering yet.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from pathlib import Path

from gateway.semantic_router.config import RouterConfigError, check_models, load_config
from gateway.semantic_router.embedding import Embedder
from gateway.semantic_router.router import SemanticRouter
from gateway.semantic_router.state import add_vectors, compile_state
from services.metrics import ROUTER_RELOADS

log = logging.getLogger(__name__)


def _stamp(path: Path) -> tuple[int, int] | None:
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_mtime_ns, st.st_size


async def open_router(
    path: str | Path, embedder: Embedder | None, served: list[str] | None = None
) -> SemanticRouter:
    """The router of a config file; RouterConfigError when it is unreadable or invalid
    (or, given ``served``, routes to a model this gateway does not serve)."""
    config = load_config(path)
    if served is not None:
        check_models(config, served)
    router = SemanticRouter(await compile_state(config, embedder), embedder)
    log.info(
        "router config %s: %d routes, virtual models %s",
        path,
        len(config.routes),
        ", ".join(config.virtual_models),
    )
    return router


class RouterReloader:
    """Polls one config file and swaps a valid new version into ``router``."""

    def __init__(
        self,
        router: SemanticRouter,
        path: str | Path,
        poll_s: float = 2.0,
        served: list[str] | None = None,
    ):
        self.router, self.path, self.poll_s, self.served = router, Path(path), poll_s, served
        self._stamp = _stamp(self.path)
        self._task: asyncio.Task | None = None
        # Set after every check; tests wait on it instead of sleeping.
        self.checked = asyncio.Event()
        self.last_error: str | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._run())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    async def _run(self) -> None:
        while True:
            await self.check()
            await asyncio.sleep(self.poll_s)  # a poll interval, not a synchronisation

    async def check(self) -> bool:
        """Reload if the file changed; retry missing embeddings. True when a new config
        was installed."""
        try:
            stamp = _stamp(self.path)
            if stamp is not None and stamp != self._stamp:
                self._stamp = stamp
                return await self._reload()
            state, embedder = self.router.state, self.router.embedder
            if state.missing_vectors and embedder is not None:
                await add_vectors(state, embedder)
            return False
        finally:
            self.checked.set()

    async def _reload(self) -> bool:
        try:
            config = load_config(self.path)
            if self.served is not None:
                check_models(config, self.served)
            state = await compile_state(config, self.router.embedder)
        except RouterConfigError as e:
            self.last_error = str(e)
            ROUTER_RELOADS.labels("refused").inc()
            log.warning("router config not reloaded, the old one stays: %s", e)
            return False
        self.router.state = state
        self.last_error = None
        ROUTER_RELOADS.labels("ok").inc()
        log.info("router config reloaded from %s: %d routes", self.path, len(config.routes))
        return True
