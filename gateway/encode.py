"""Step 3 of the request path: make sure every image of a request has an embedding.

Each distinct image goes to ``epd.encode`` (any encoder replica); the encoder answers
from Redis when the image is known, so a repeated image costs one Redis GET there and
no tower pass. The gateway itself needs no Redis connection.
"""

from __future__ import annotations

import asyncio

from cache_svc.embedding_store import embedding_key
from gateway.events import BackendError
from gateway.prepare import PreparedRequest
from protos.epd_pb import bus_pb2
from services.bus import subjects
from services.bus.connection import Bus
from services.bus.errors import BusError, NoResponders
from services.wire import STATUS


class ImageEncoder:
    def __init__(self, bus: Bus, fingerprint: str, timeout_s: float):
        self.bus = bus
        self.fingerprint = fingerprint
        self.timeout_s = timeout_s

    def keys_for(self, prep: PreparedRequest) -> dict[str, str]:
        return {s.image_hash: embedding_key(self.fingerprint, s.image_hash) for s in prep.spans}

    async def encode(self, prep: PreparedRequest) -> dict[str, bus_pb2.Tensor]:
        """Encode what is missing; returns embeddings the encoder could not cache (Redis down)."""
        unique = {}
        for span, image in zip(prep.spans, prep.images, strict=True):
            unique.setdefault(span.image_hash, image)
        results = await asyncio.gather(*(self._one(prep, h, img) for h, img in unique.items()))
        return {h: t for h, t in results if t is not None}

    async def _one(self, prep: PreparedRequest, digest: str, image: bytes):
        req = bus_pb2.EncodeRequest(request_id=prep.request_id, model_fingerprint=self.fingerprint,
                                    image=image, image_hash=digest,
                                    deadline_unix_ms=int(prep.deadline * 1000))  # fmt: skip
        try:
            reply = await self.bus.request(
                subjects.ENCODE, req, bus_pb2.EncodeReply, self.timeout_s
            )
        except NoResponders as e:
            raise BackendError("UNAVAILABLE", "no encoder instance is serving") from e
        except BusError as e:
            raise BackendError("UNAVAILABLE", f"encoding failed: {e}") from e
        if reply.HasField("error"):
            raise BackendError(STATUS.get(reply.error.code, "INTERNAL"), reply.error.message)
        return digest, (reply.embedding if reply.HasField("embedding") else None)
