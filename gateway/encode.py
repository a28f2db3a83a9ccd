"""Step 3 of the request path: make sure every image of a request has an embedding.

Each distinct image goes to an encoder the router picks (``epd.encoder.<fp>.<id>``); the
encoder answers from Redis when the image is known, so a repeated image costs one Redis
GET there and no tower pass. The gateway itself needs no Redis connection. An encoder
that dies, refuses or goes silent mid-encode is left for another one at once (the
gateway watches its heartbeats while it waits).

An image too large for one bus message is never shipped blindly: the gateway first
asks by hash alone; only when no embedding is cached does it send the bytes (chunked,
to one chosen encoder's blob subject) and ask that encoder again. When Redis cannot
hold an embedding, the encoder sends it straight to the prefill instance that will use
it (a blob there); the gateway only passes the reference on.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import Awaitable, Callable

from cache_svc.keys import embedding_key
from gateway.attempt import RETRYABLE, WorkerLost, while_alive
from gateway.events import BackendError
from gateway.prepare import PreparedRequest
from gateway.router import Router
from protos.epd_pb import bus_pb2
from services.bus import subjects
from services.bus.blobs import fits_inline, send_blob
from services.bus.connection import Bus
from services.bus.errors import BusError
from services.metrics import MIGRATIONS
from services.wire import STATUS

log = logging.getLogger(__name__)


class ImageEncoder:
    """Encodes a request's images on encoders chosen by ``router``; ``alive(role, id)``
    says whether an instance still beats, ``probe(role, id)`` whether it is connected."""

    def __init__(self, bus: Bus, fingerprint: str, timeout_s: float, router: Router,
                 alive: Callable[[str, str], bool],
                 probe: Callable[[str, str], Awaitable[bool]]):  # fmt: skip
        self.bus = bus
        self.fingerprint = fingerprint
        self.timeout_s = timeout_s
        self.router = router
        self.alive = alive
        self.probe = probe

    def keys_for(self, prep: PreparedRequest) -> dict[str, str]:
        return {s.image_hash: embedding_key(self.fingerprint, s.image_hash) for s in prep.spans}

    async def encode(self, prep: PreparedRequest, prefill_id: str,
                     push: bool = False) -> dict[str, bus_pb2.BlobRef]:  # fmt: skip
        """Encode what is missing; returns the embeddings the encoder sent to prefill
        ``prefill_id`` itself because Redis could not hold them (every one: ``push``)."""
        unique = {}
        for span, image in zip(prep.spans, prep.images, strict=True):
            unique.setdefault(span.image_hash, image)
        results = await asyncio.gather(
            *(self._one(prep, h, img, prefill_id, push) for h, img in unique.items())
        )
        return {h: ref for h, ref in results if ref is not None}

    async def _one(self, prep: PreparedRequest, digest: str, image: bytes, prefill_id: str,
                   push: bool):  # fmt: skip
        """One image, on one encoder after another until one answers."""
        failed: set[str] = set()
        while True:
            lease = self.router.pick(subjects.ROLE_ENCODE, exclude=failed)
            try:
                reply = await self._on(lease.instance_id, prep, digest, image, prefill_id, push)
            except WorkerLost as lost:
                lease.failed()
                failed.add(lease.instance_id)
                MIGRATIONS.labels(subjects.ROLE_ENCODE, "retry").inc()
                log.warning("image %s moves on: %s", digest[:12], lost)
                continue
            finally:
                lease.release()
            self.router.succeeded(subjects.ROLE_ENCODE, lease.instance_id)
            return digest, (reply.embedding_ref if reply.HasField("embedding_ref") else None)

    async def _on(self, encoder_id: str, prep: PreparedRequest, digest: str, image: bytes,
                  prefill_id: str, push: bool) -> bus_pb2.EncodeReply:  # fmt: skip
        req = bus_pb2.EncodeRequest(request_id=prep.request_id, model_fingerprint=self.fingerprint,
                                    image_hash=digest, deadline_unix_ms=int(prep.deadline * 1000),
                                    prefill_instance_id=prefill_id,
                                    embedding_transfer_id=f"emb-{uuid.uuid4().hex}",
                                    push_to_prefill=push)  # fmt: skip
        if fits_inline(self.bus, len(image)):
            req.image = image
        reply = await self._ask(encoder_id, req)
        if reply.need_image:  # large and not cached: send the bytes first
            try:
                ref = await send_blob(self.bus, encoder_id, image, self.timeout_s)
            except BusError as e:
                raise WorkerLost(subjects.ROLE_ENCODE, encoder_id, f"image send: {e}") from e
            req.image_ref.CopyFrom(ref)
            reply = await self._ask(encoder_id, req)
        if reply.HasField("error"):
            code = STATUS.get(reply.error.code, "INTERNAL")
            if code in RETRYABLE:
                raise WorkerLost(subjects.ROLE_ENCODE, encoder_id, reply.error.message)
            raise BackendError(code, reply.error.message)
        if reply.need_image:
            raise BackendError("INTERNAL", "the encoder asked again for an image it was sent")
        return reply

    async def _ask(self, encoder_id: str, req: bus_pb2.EncodeRequest) -> bus_pb2.EncodeReply:
        ask = self.bus.request(subjects.encoder(self.fingerprint, encoder_id), req,
                               bus_pb2.EncodeReply, self.timeout_s)  # fmt: skip
        try:
            return await while_alive(
                ask, lambda: self.alive(subjects.ROLE_ENCODE, encoder_id),
                lambda: WorkerLost(subjects.ROLE_ENCODE, encoder_id, "went away mid-encode"),
                lambda: self.probe(subjects.ROLE_ENCODE, encoder_id),
            )  # fmt: skip
        except BusError as e:
            raise WorkerLost(subjects.ROLE_ENCODE, encoder_id, f"encode failed: {e}") from e


class EmbeddingsMissing(Exception):
    """The prefill instance could not read an image's embedding."""


class Encodings:
    """A request's images, encoded once per prefill instance its choices use (the
    embeddings an encoder pushed to one prefill serve every choice there)."""

    def __init__(self, encoder: ImageEncoder, prep: PreparedRequest):
        self.encoder, self.prep = encoder, prep
        self.by_prefill: dict[tuple[str, bool], asyncio.Future] = {}

    async def for_prefill(self, prefill_id: str, push: bool = False) -> dict[str, bus_pb2.BlobRef]:
        """``push``: send the embeddings to the prefill instance even if Redis has them."""
        if not self.prep.spans:
            return {}
        fut = self.by_prefill.get((prefill_id, push))
        if fut is None:
            fut = asyncio.ensure_future(self.encoder.encode(self.prep, prefill_id, push))
            fut.add_done_callback(lambda f: f.cancelled() or f.exception())
            self.by_prefill[(prefill_id, push)] = fut
        return await asyncio.shield(fut)  # one choice giving up must not cancel the others'

    def cancel(self) -> None:
        for fut in self.by_prefill.values():
            fut.cancel()
