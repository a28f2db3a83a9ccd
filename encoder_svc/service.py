"""The encoder service: vision tower + projector, embeddings written to Redis.

Takes ``epd.encode.<model>`` requests in a queue group (any replica may answer), and on
``epd.encoder.<id>`` those whose image was sent ahead to this instance's blob inbox. A
repeated image costs one Redis GET; concurrent requests for the same image encode it
once. When Redis cannot hold an embedding, it goes to the request's prefill instance as
a blob (services/bus/blobs.py).
"""

from __future__ import annotations

import asyncio
import logging
import uuid

import torch

from cache_svc.embedding_store import (
    EmbeddingStore,
    EmbeddingStoreConfig,
    embedding_key,
    pack_embedding,
)
from encoder_svc.batcher import EncodeBatcher
from protos.epd_pb import bus_pb2
from services.bus import subjects
from services.bus.blobs import BlobInbox, send_blob
from services.bus.deadline import timeout_for
from services.bus.errors import BusError
from services.bus.handlers import Incoming
from services.bus.heartbeat import HeartbeatPublisher, Load
from services.config import EngineConfig, ServiceConfig
from services.images import ImageError, ImagePreprocessor, decode_image, image_hash
from services.metrics import (
    EMBEDDING_CACHE_BYTES,
    EMBEDDING_CACHE_HITS,
    EMBEDDING_CACHE_MISSES,
    EMBEDDING_SINGLEFLIGHT_JOINS,
    IMAGES_ENCODED,
)
from services.models.factory import load_vision_encoder
from services.runtime import connect_bus
from services.singleflight import SingleFlight
from services.wire import error

log = logging.getLogger(__name__)
_INVALID = bus_pb2.ERROR_CODE_INVALID_ARGUMENT


class EncoderService:
    role = subjects.ROLE_ENCODE

    def __init__(self, engine_config: EngineConfig, config: ServiceConfig):
        self.engine_config = engine_config
        self.config = config
        self.instance_id = config.instance_id or f"encoder-{uuid.uuid4().hex[:8]}"
        self.bus = self.store = self.heartbeat = self.blobs = None
        self.flight: SingleFlight[str, torch.Tensor] = SingleFlight()
        self.in_flight = 0
        self._stopped = False

    async def start(self) -> None:
        self.model = load_vision_encoder(self.engine_config)
        self.fingerprint = self.model.fingerprint
        self.preprocessor = ImagePreprocessor(self.model.model_dir)
        self.batcher = EncodeBatcher(self._encode_batch, self.config.encode_batch_window_ms / 1e3)
        self.store = EmbeddingStore.from_config(
            EmbeddingStoreConfig(url=self.config.redis_url, ttl_s=self.config.embedding_ttl_s)
        )
        self.bus = await connect_bus(self.config, self.instance_id)
        self.blobs = BlobInbox(self.bus, self.instance_id, self.config.max_blob_mb << 20)
        await self.blobs.start()
        await self.bus.subscribe(subjects.encode(self.fingerprint), self._on_encode, queue=subjects.QUEUE_ENCODE,
                                 max_concurrency=64)  # fmt: skip
        await self.bus.subscribe(subjects.encoder(self.instance_id), self._on_encode,
                                 max_concurrency=64)  # fmt: skip
        self.heartbeat = HeartbeatPublisher(self.bus, self.role, self.instance_id, self._load,
                                            interval_s=self.config.heartbeat_s, model=self.fingerprint)  # fmt: skip
        await self.heartbeat.start()
        log.info("encoder %s ready (model %s)", self.instance_id, self.fingerprint)

    def _load(self) -> Load:
        return Load(running=self.in_flight)

    @torch.inference_mode()
    def _encode_batch(self, images: list) -> list[torch.Tensor]:
        """Worker thread: preprocess and encode a batch of PIL images -> one tensor each."""
        pixels = self.preprocessor(images).to(self.model.device)
        out = self.model.model(pixels)
        IMAGES_ENCODED.inc(len(images))
        return [e.detach().to("cpu").contiguous() for e in out]

    async def _encode_and_store(self, image, digest: str) -> tuple[torch.Tensor, bool]:
        emb = await self.batcher.submit(image)
        stored = await self.store.put(self.fingerprint, digest, emb)
        if stored:
            EMBEDDING_CACHE_BYTES.inc(emb.numel() * emb.element_size())
        return emb, stored

    async def _on_encode(self, msg: Incoming) -> None:
        req = msg.decode(bus_pb2.EncodeRequest)
        self.in_flight += 1
        try:
            await msg.respond(await self._encode(req))
        finally:
            self.in_flight -= 1

    async def _encode(self, req: bus_pb2.EncodeRequest) -> bus_pb2.EncodeReply:
        reply = bus_pb2.EncodeReply(image_hash=req.image_hash)
        if req.model_fingerprint != self.fingerprint:
            return _failed(reply, _INVALID, f"encoder serves model {self.fingerprint}, "
                                            f"not {req.model_fingerprint}")  # fmt: skip
        try:
            reply.embedding_key = embedding_key(self.fingerprint, req.image_hash)
        except ValueError as e:
            return _failed(reply, _INVALID, str(e))
        emb = await self.store.get(self.fingerprint, req.image_hash)
        if emb is not None:
            EMBEDDING_CACHE_HITS.inc()
            reply.num_tokens = emb.shape[0]
            return reply
        try:
            data = await self._image_bytes(req)
        except BusError as e:
            return _failed(reply, bus_pb2.ERROR_CODE_UNAVAILABLE, f"image transfer failed: {e}")
        if data is None:
            reply.need_image = True  # asked by hash alone, and not cached
            return reply
        if image_hash(data, self.fingerprint) != req.image_hash:
            return _failed(reply, _INVALID, "image_hash does not match the image bytes")
        EMBEDDING_CACHE_MISSES.inc()
        if self.flight.inflight(req.image_hash):
            EMBEDDING_SINGLEFLIGHT_JOINS.inc()
        try:
            image = await asyncio.to_thread(decode_image, data)
            emb, stored = await self.flight.do(
                req.image_hash, lambda: self._encode_and_store(image, req.image_hash)
            )
        except ImageError as e:
            return _failed(reply, _INVALID, str(e))
        reply.num_tokens = emb.shape[0]
        if not stored:  # Redis is down: hand the embedding to its prefill instance
            return await self._push(req, reply, emb)
        return reply

    async def _image_bytes(self, req: bus_pb2.EncodeRequest) -> bytes | bytearray | None:
        if req.HasField("image_ref"):
            timeout = timeout_for(req.deadline_unix_ms, "image receive", self.config.bus_timeout_s)
            return await self.blobs.take(req.image_ref, timeout)
        return req.image or None

    async def _push(self, req, reply: bus_pb2.EncodeReply, emb: torch.Tensor):
        if not req.prefill_instance_id or not req.embedding_transfer_id:
            return _failed(reply, bus_pb2.ERROR_CODE_UNAVAILABLE,
                           "the embedding cache is down and the request names no prefill instance")  # fmt: skip
        try:
            timeout = timeout_for(req.deadline_unix_ms, "embedding push", self.config.bus_timeout_s)
            ref = await send_blob(self.bus, req.prefill_instance_id, pack_embedding(emb), timeout,
                                  transfer_id=req.embedding_transfer_id)  # fmt: skip
        except (BusError, ValueError) as e:
            return _failed(reply, bus_pb2.ERROR_CODE_UNAVAILABLE, f"embedding push failed: {e}")
        reply.embedding_ref.CopyFrom(ref)
        return reply

    async def stop(self) -> None:
        """Stop heartbeats, drain the bus (in-flight encodes finish), close Redis; idempotent."""
        if self._stopped:
            return
        self._stopped = True
        if self.heartbeat is not None:
            await self.heartbeat.stop()
        if self.blobs is not None:
            await self.blobs.close()
        if self.bus is not None:
            await self.bus.close()
        if self.store is not None:
            await self.store.close()


def _failed(reply: bus_pb2.EncodeReply, code: int, message: str) -> bus_pb2.EncodeReply:
    reply.error.CopyFrom(error(code, message))
    return reply
