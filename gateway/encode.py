"""Step 3 of the request path: make sure every image of a request has an embedding.

Each distinct image goes to ``epd.encode.<model>`` (any encoder replica of the model);
the encoder answers from Redis when the image is known, so a repeated image costs one
Redis GET there and no tower pass. The gateway itself needs no Redis connection.

An image too large for one bus message is never shipped blindly: the gateway first
asks by hash alone; only when no embedding is cached does it send the bytes (chunked,
to one chosen encoder's blob subject) and ask that encoder again. When Redis cannot
hold an embedding, the encoder sends it straight to the prefill instance that will use
it (a blob there); the gateway only passes the reference on.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Callable

from cache_svc.keys import embedding_key
from gateway.events import BackendError
from gateway.prepare import PreparedRequest
from protos.epd_pb import bus_pb2
from services.bus import subjects
from services.bus.blobs import fits_inline, send_blob
from services.bus.connection import Bus
from services.bus.errors import BusError, NoResponders
from services.wire import STATUS


class ImageEncoder:
    """``pick_encoder()`` names the encoder instance that gets a large image."""

    def __init__(self, bus: Bus, fingerprint: str, timeout_s: float,
                 pick_encoder: Callable[[], str]):  # fmt: skip
        self.bus = bus
        self.fingerprint = fingerprint
        self.timeout_s = timeout_s
        self.pick_encoder = pick_encoder

    def keys_for(self, prep: PreparedRequest) -> dict[str, str]:
        return {s.image_hash: embedding_key(self.fingerprint, s.image_hash) for s in prep.spans}

    async def encode(self, prep: PreparedRequest, prefill_id: str) -> dict[str, bus_pb2.BlobRef]:
        """Encode what is missing; returns the embeddings the encoder sent to prefill
        ``prefill_id`` itself because Redis could not hold them."""
        unique = {}
        for span, image in zip(prep.spans, prep.images, strict=True):
            unique.setdefault(span.image_hash, image)
        results = await asyncio.gather(
            *(self._one(prep, h, img, prefill_id) for h, img in unique.items())
        )
        return {h: ref for h, ref in results if ref is not None}

    async def _one(self, prep: PreparedRequest, digest: str, image: bytes, prefill_id: str):
        req = bus_pb2.EncodeRequest(request_id=prep.request_id, model_fingerprint=self.fingerprint,
                                    image_hash=digest, deadline_unix_ms=int(prep.deadline * 1000),
                                    prefill_instance_id=prefill_id,
                                    embedding_transfer_id=f"emb-{uuid.uuid4().hex}")  # fmt: skip
        if fits_inline(self.bus, len(image)):
            req.image = image
        reply = await self._ask(subjects.encode(self.fingerprint), req)
        if reply.need_image:  # large and not cached: send the bytes to one encoder
            encoder_id = self.pick_encoder()
            try:
                ref = await send_blob(self.bus, encoder_id, image, self.timeout_s)
            except BusError as e:
                raise BackendError("UNAVAILABLE", f"sending the image failed: {e}") from e
            req.image_ref.CopyFrom(ref)
            reply = await self._ask(subjects.encoder(encoder_id), req)
        if reply.HasField("error"):
            raise BackendError(STATUS.get(reply.error.code, "INTERNAL"), reply.error.message)
        if reply.need_image:
            raise BackendError("INTERNAL", "the encoder asked again for an image it was sent")
        return digest, (reply.embedding_ref if reply.HasField("embedding_ref") else None)

    async def _ask(self, subject: str, req: bus_pb2.EncodeRequest) -> bus_pb2.EncodeReply:
        try:
            return await self.bus.request(subject, req, bus_pb2.EncodeReply, self.timeout_s)
        except NoResponders as e:
            raise BackendError("UNAVAILABLE", "no encoder instance is serving") from e
        except BusError as e:
            raise BackendError("UNAVAILABLE", f"encoding failed: {e}") from e
