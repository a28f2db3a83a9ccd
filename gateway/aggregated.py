"""``serve all``: the whole engine in the gateway's process (the comparison baseline).

Images go through ``gateway/image_embeddings.py`` first (LRU, then the fleet's Redis
embedding cache): the engine gets their embeddings, and the tower runs only on misses,
in its own thread (micro-batched), so a fresh image does not hold up the steps of
requests whose images are known.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

import torch

from gateway.events import BackendError, TokenEvent, events_from_output
from gateway.image_embeddings import ImageEmbeddings
from gateway.prepare import PreparedRequest
from services import metrics
from services.embeddings.store import EmbeddingStore, EmbeddingStoreConfig
from services.engine.async_engine import AsyncEngine, EngineDeadError
from services.engine.parallel_sampling import child_request_id
from services.images import decode_image
from services.metrics import ENCODE_BATCH
from services.microbatch import MicroBatcher
from services.models.image_grid import ImageOptions
from services.structured.outputs import StructuredOutputs


class AggregatedBackend:
    """Serves prepared requests from an in-process ``AsyncEngine`` (n > 1 included: the
    engine runs the choices over one prompt)."""

    def __init__(
        self,
        engine: AsyncEngine,
        instance_id: str = "all",
        store: EmbeddingStoreConfig | None = None,
    ):
        """``store``: the Redis embedding cache shared with the fleet (None: LRU only)."""
        self.engine = engine
        self.instance_id = instance_id
        lm = engine.engine.loaded
        self.tower = MicroBatcher(engine.engine.encode_images, observe=ENCODE_BATCH.observe)
        self._store = EmbeddingStore.from_config(store) if store is not None else None
        self.images = ImageEmbeddings(
            self._encode, self._store, lm.fingerprint, lm.image_embedding_width, lm.dtype
        )

    def refresh_metrics(self) -> None:
        """The engine's load gauges (a fleet instance sets them on every heartbeat; this
        process sends none, so they are read when /metrics is scraped)."""
        load, labels = self.engine.load(), ("all", self.instance_id)
        metrics.RUNNING.labels(*labels).set(load["running"])
        metrics.WAITING.labels(*labels).set(load["waiting"])
        metrics.KV_BLOCKS_FREE.labels(*labels).set(load["free_blocks"])
        metrics.KV_BLOCKS_USED.labels(*labels).set(load["total_blocks"] - load["free_blocks"])

    async def start(self) -> None:
        self.engine.start()

    async def stop(self) -> None:
        await self.engine.shutdown()
        if self._store is not None:
            await self._store.close()

    async def _encode(self, data: bytes, options: ImageOptions) -> torch.Tensor:
        """The tower on one image, in a worker thread beside the engine's (its weights are
        read-only there), so the other requests' steps go on meanwhile; images that queue
        up during a pass share the next one."""
        image = await asyncio.to_thread(decode_image, data)
        return await self.tower.submit((image, options))

    async def _inputs(self, prep: PreparedRequest) -> tuple[dict, list[torch.Tensor] | None]:
        """The engine's prompt and the images' embeddings (None: a text-only request)."""
        if not prep.images:
            return {"prompt_token_ids": prep.prompt_token_ids}, None
        try:
            async with asyncio.timeout(max(0.0, prep.deadline - time.time())):
                embeds = await self.images.embeddings(prep.images, prep.spans, prep.image_options)
        except TimeoutError as e:
            raise BackendError("DEADLINE_EXCEEDED", "the request ran past its deadline") from e
        return {"prompt_token_ids": prep.prompt_token_ids, "image_spans": prep.spans}, embeds

    async def generate(self, prep: PreparedRequest) -> AsyncIterator[TokenEvent]:
        prompt, embeds = await self._inputs(prep)
        n = prep.params.logprobs or 0
        outputs = self.engine.generate(
            prep.request_id, prompt, prep.params, deadline=prep.deadline, image_embeds=embeds
        )
        try:
            async for out in outputs:
                for event in events_from_output(out, n):
                    yield event
        except TimeoutError as e:
            raise BackendError("DEADLINE_EXCEEDED", "the request ran past its deadline") from e
        except EngineDeadError as e:
            raise BackendError("UNAVAILABLE", str(e)) from e
        finally:
            await outputs.aclose()

    async def check_constraint(self, constraint: StructuredOutputs) -> None:
        """ValueError when the engine cannot compile ``constraint`` (in a thread: the
        first one builds the tokenizer's table)."""
        await asyncio.to_thread(self.engine.engine.grammars.check, constraint)

    async def abort(self, prep: PreparedRequest, index: int | None = None) -> None:
        rid = prep.request_id
        if index is not None and prep.params.n > 1:
            rid = child_request_id(rid, index)
        await self.engine.abort(rid)

    def ready(self) -> bool:
        return self.engine.alive

    def busy(self) -> bool:
        """Requests running or waiting in the engine (read racily)."""
        load = self.engine.load()
        return load["running"] + load["waiting"] > 0
