"""Step 3 of the request path: make sure every image of a request has an embedding.

Each distinct image goes to an encoder the router picks (``epd.encoder.<fp>.<id>``); the
encoder answers from Redis when the image is known, so a repeated image costs one Redis
GET there and no tower pass. The gateway itself needs no Redis connection. An encoder
that dies, refuses or goes silent mid-encode is left for another one at once (the
gateway watches its heartbeats while it waits). One that is alive and keeps finishing
tower passes (its heartbeats' step count) is busy, not stuck: a request waits on it up
to its own deadline, however long the queue there; only ``stall_s`` without a reply and
without a finished pass sends the image elsewhere.

An image too large for one bus message is never shipped blindly: the gateway first
asks by hash alone; only when no embedding is cached does it send the bytes (chunked,
to one chosen encoder's blob subject) and ask that encoder again. When Redis cannot
hold an embedding, the encoder sends it straight to the prefill instance that will use
it (a blob there); the gateway only passes the reference on.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid

from gateway.attempt import RETRYABLE, WorkerLost, WorkerWatch, while_alive
from gateway.events import BackendError
from gateway.prepare import PreparedRequest
from gateway.router import Router
from protos.epd_pb import bus_pb2
from services.bus import subjects
from services.bus.blobs import fits_inline, send_blob
from services.bus.connection import Bus
from services.bus.errors import BusError, BusTimeout
from services.embeddings.keys import embedding_key
from services.metrics import MIGRATIONS
from services.wire import STATUS, options_to_proto

log = logging.getLogger(__name__)


class ImageEncoder:
    """Encodes a request's images on encoders chosen by ``router``; ``watch`` says
    whether an instance still beats, is connected, and when it last finished a pass."""

    def __init__(
        self,
        bus: Bus,
        fingerprint: str,
        timeout_s: float,
        stall_s: float,
        router: Router,
        watch: WorkerWatch,
    ):
        """``timeout_s``: bus transfers (an image's bytes); ``stall_s``: how long an
        encoder may go without replying and without finishing a pass."""
        self.bus = bus
        self.fingerprint = fingerprint
        self.timeout_s = timeout_s
        self.stall_s = stall_s
        self.router = router
        self.watch = watch

    def keys_for(self, prep: PreparedRequest) -> dict[str, str]:
        return {s.image_hash: embedding_key(self.fingerprint, s.image_hash) for s in prep.spans}

    async def encode(
        self, prep: PreparedRequest, prefill_id: str, push: bool = False
    ) -> dict[str, bus_pb2.BlobRef]:
        """Encode what is missing; returns the embeddings the encoder sent to prefill
        ``prefill_id`` itself because Redis could not hold them (every one: ``push``)."""
        unique = {}
        for span, image in zip(prep.spans, prep.images, strict=True):
            unique.setdefault(span.image_hash, image)
        results = await asyncio.gather(
            *(self._one(prep, h, img, prefill_id, push) for h, img in unique.items())
        )
        return {h: ref for h, ref in results if ref is not None}

    async def _one(
        self, prep: PreparedRequest, digest: str, image: bytes, prefill_id: str, push: bool
    ):
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

    async def _on(
        self,
        encoder_id: str,
        prep: PreparedRequest,
        digest: str,
        image: bytes,
        prefill_id: str,
        push: bool,
    ) -> bus_pb2.EncodeReply:
        req = bus_pb2.EncodeRequest(
            request_id=prep.request_id,
            model_fingerprint=self.fingerprint,
            image_hash=digest,
            deadline_unix_ms=int(prep.deadline * 1000),
            prefill_instance_id=prefill_id,
            embedding_transfer_id=f"emb-{uuid.uuid4().hex}",
            push_to_prefill=push,
            options=options_to_proto(prep.image_options),
        )
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
        """The encoder's reply, waited for up to the request's deadline while the encoder
        beats and finishes tower passes (a queue of images ahead of this one is work)."""
        deadline = req.deadline_unix_ms / 1000 if req.deadline_unix_ms else None
        left = deadline - time.time() if deadline is not None else self.timeout_s
        if left <= 0:
            raise BackendError("DEADLINE_EXCEEDED", "the request ran past its deadline")
        role, asked = subjects.ROLE_ENCODE, time.monotonic()
        ask = self.bus.request(
            subjects.encoder(self.fingerprint, encoder_id), req, bus_pb2.EncodeReply, left
        )
        try:
            return await while_alive(
                ask,
                lambda: self.watch.alive(role, encoder_id),
                lambda: WorkerLost(role, encoder_id, "went away mid-encode"),
                lambda: self.watch.answers_ping(role, encoder_id),
                lambda: self._stalled(encoder_id, asked),
            )
        except BusTimeout as e:
            if deadline is not None and time.time() >= deadline - 0.01:
                raise BackendError("DEADLINE_EXCEEDED", "the request ran past its deadline") from e
            raise WorkerLost(role, encoder_id, f"encode failed: {e}") from e
        except BusError as e:
            raise WorkerLost(role, encoder_id, f"encode failed: {e}") from e

    def _stalled(self, encoder_id: str, asked: float) -> WorkerLost | None:
        """A stall: neither a reply nor a finished tower pass for the stall timeout, and
        never sooner than the bus timeout (one pass over a huge image, or its decode,
        may take that long without any pass finishing)."""
        limit = max(self.stall_s, self.timeout_s)
        busy_at = self.watch.progressed_at(subjects.ROLE_ENCODE, encoder_id) or 0.0
        if time.monotonic() - max(asked, busy_at) <= limit:
            return None
        return WorkerLost(
            subjects.ROLE_ENCODE, encoder_id, f"no embedding and no tower pass for {limit:.0f}s"
        )


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
