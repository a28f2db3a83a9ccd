"""The encoder service: vision tower + projector, embeddings written to Redis.

Takes the images the gateway's router assigns it on ``epd.encoder.<fp>.<id>`` (inline, or
sent ahead to this instance's blob inbox when too large for one message). A
repeated image costs one Redis GET; concurrent requests for the same image encode it
once. When Redis cannot hold an embedding, it goes to the request's prefill instance as
a blob (services/bus/blobs.py). An in-process LRU behind Redis keeps a repeat from being
encoded again when Redis lost or never took its embedding (down, slow, evicted).
"""

from __future__ import annotations

import asyncio
import logging

import torch

from protos.epd_pb import bus_pb2
from services.bus import subjects
from services.bus.blobs import BlobInbox, send_blob
from services.bus.deadline import timeout_for
from services.bus.errors import BusError
from services.bus.handlers import Incoming
from services.bus.heartbeat import Load
from services.config import EngineConfig, ServiceConfig
from services.embeddings.lru import DEFAULT_BYTES, EmbeddingLRU
from services.embeddings.store import (
    EmbeddingStore,
    EmbeddingStoreConfig,
    embedding_key,
    pack_embedding,
)
from services.images import (
    ImageError,
    ImagePreprocessor,
    decode_image,
    encode_batch,
    image_hash,
)
from services.metrics import (
    EMBEDDING_CACHE_BYTES,
    EMBEDDING_CACHE_HITS,
    EMBEDDING_CACHE_MISSES,
    EMBEDDING_SINGLEFLIGHT_JOINS,
    ENCODE_BATCH,
    ENCODE_SECONDS,
    IMAGES_ENCODED,
)
from services.microbatch import MicroBatcher
from services.models.factory import load_vision_encoder
from services.observability import bind_request
from services.service import Service
from services.singleflight import SingleFlight
from services.wire import error, options_from_proto

log = logging.getLogger(__name__)
_INVALID = bus_pb2.ERROR_CODE_INVALID_ARGUMENT


class EncoderService(Service):
    """Encodes images for prefill; in flight = the encode handlers running."""

    role = subjects.ROLE_ENCODE

    def __init__(self, engine_config: EngineConfig, config: ServiceConfig):
        super().__init__(config)
        self.engine_config = engine_config
        self.store = self.blobs = None
        self.flight: SingleFlight[str, torch.Tensor] = SingleFlight()
        self.recent = EmbeddingLRU(DEFAULT_BYTES)

    async def load(self) -> None:
        # In a thread: the loop keeps answering signals while the weights load.
        self.model = await asyncio.to_thread(load_vision_encoder, self.engine_config)
        self.fingerprint = self.model_fingerprint = self.model.fingerprint
        self.preprocessor = ImagePreprocessor(self.model.model_dir)
        # Small passes on CPU: each finished pass is the progress a waiting gateway sees
        # (heartbeat steps), and a pass of 16 ViT-B/16 images takes ~10 s on one core,
        # for little more throughput than 4 at a time. A GPU batch is fast either way.
        cpu = torch.device(self.model.device).type == "cpu"
        self.batcher = MicroBatcher(
            self._encode_batch,
            max_batch=4 if cpu else 32,
            window_s=self.config.encode_batch_window_ms / 1e3,
            observe=ENCODE_BATCH.observe,
        )
        self.store = EmbeddingStore.from_config(
            EmbeddingStoreConfig(url=self.config.redis_url, ttl_s=self.config.embedding_ttl_s)
        )

    async def register(self) -> None:
        self.blobs = BlobInbox(self.bus, self.instance_id, self.config.max_blob_mb << 20)
        await self.blobs.start()
        # The image was sent ahead to this instance: refused while draining.
        await self.serve_work(
            subjects.encoder(self.fingerprint, self.instance_id),
            self._on_encode,
            bus_pb2.EncodeReply,
        )

    def report_load(self) -> Load:
        """Handlers running, images queued, and tower passes done as the step count."""
        batcher = getattr(self, "batcher", None)
        if batcher is None:  # still loading
            return Load(running=self.active)
        return Load(running=self.active, waiting=batcher.waiting, steps=batcher.batches)

    @torch.inference_mode()
    def _encode_batch(self, items: list) -> list[torch.Tensor]:
        """Worker thread: [(PIL image, ImageOptions)] preprocessed and encoded -> one
        tensor each."""
        with ENCODE_SECONDS.time():
            out = encode_batch(self.model.model, self.preprocessor, items, self.model.device)
        IMAGES_ENCODED.inc(len(items))
        return [e.detach().to("cpu").contiguous() for e in out]

    async def _encode_and_store(self, item, digest: str) -> tuple[torch.Tensor, bool]:
        emb = self.recent.get(digest)
        if emb is not None:
            # Encoded here (and its flight ended) while this request's image was still
            # arriving, after its cache lookup missed: the first encode's, not a second.
            return emb, await self.store.put(self.fingerprint, digest, emb)
        emb = await self.batcher.submit(item)
        self.recent.put(digest, emb)
        stored = await self.store.put(self.fingerprint, digest, emb)
        if stored:
            EMBEDDING_CACHE_BYTES.inc(emb.numel() * emb.element_size())
        return emb, stored

    async def _on_encode(self, msg: Incoming) -> None:
        await msg.respond(await self._encode(msg.decode(bus_pb2.EncodeRequest)))

    async def _encode(self, req: bus_pb2.EncodeRequest) -> bus_pb2.EncodeReply:
        bind_request(req.request_id)
        log.debug("encode image %s", req.image_hash[:12])
        reply = bus_pb2.EncodeReply(image_hash=req.image_hash)
        if req.model_fingerprint != self.fingerprint:
            return _failed(
                reply,
                _INVALID,
                f"encoder serves model {self.fingerprint}, not {req.model_fingerprint}",
            )
        try:
            reply.embedding_key = embedding_key(self.fingerprint, req.image_hash)
            options = options_from_proto(req.options)
            self.model.info.image_grid.check_options(options)  # within the model's budget
        except ValueError as e:
            return _failed(reply, _INVALID, str(e))
        emb = await self.store.get(self.fingerprint, req.image_hash)
        if emb is not None:
            EMBEDDING_CACHE_HITS.inc()
            reply.num_tokens = emb.shape[0]
            return await self._push(req, reply, emb) if req.push_to_prefill else reply
        emb = self.recent.get(req.image_hash) if req.prefill_instance_id else None
        if emb is not None:  # encoded here, but not in Redis: to the prefill instance
            EMBEDDING_CACHE_HITS.inc()
            reply.num_tokens = emb.shape[0]
            return await self._push(req, reply, emb)
        try:
            data = await self._image_bytes(req)
        except BusError as e:
            return _failed(reply, bus_pb2.ERROR_CODE_UNAVAILABLE, f"image transfer failed: {e}")
        if data is None:
            reply.need_image = True  # asked by hash alone, and not cached
            return reply
        if image_hash(data, self.fingerprint + options.key()) != req.image_hash:
            return _failed(reply, _INVALID, "image_hash does not match the image bytes")
        EMBEDDING_CACHE_MISSES.inc()
        if self.flight.inflight(req.image_hash):
            EMBEDDING_SINGLEFLIGHT_JOINS.inc()
        try:
            image = await asyncio.to_thread(decode_image, data)
            emb, stored = await self.flight.do(
                req.image_hash, lambda: self._encode_and_store((image, options), req.image_hash)
            )
        except ImageError as e:
            return _failed(reply, _INVALID, str(e))
        reply.num_tokens = emb.shape[0]
        if not stored or req.push_to_prefill:  # hand the embedding to its prefill instance
            return await self._push(req, reply, emb)
        return reply

    async def _image_bytes(self, req: bus_pb2.EncodeRequest) -> bytes | bytearray | None:
        if req.HasField("image_ref"):
            timeout = timeout_for(req.deadline_unix_ms, "image receive", self.config.bus_timeout_s)
            return await self.blobs.take(req.image_ref, timeout)
        return req.image or None

    async def _push(self, req, reply: bus_pb2.EncodeReply, emb: torch.Tensor):
        if not req.prefill_instance_id or not req.embedding_transfer_id:
            return _failed(
                reply,
                bus_pb2.ERROR_CODE_UNAVAILABLE,
                "the embedding cache is down and the request names no prefill instance",
            )
        try:
            timeout = timeout_for(req.deadline_unix_ms, "embedding push", self.config.bus_timeout_s)
            ref = await send_blob(
                self.bus,
                req.prefill_instance_id,
                pack_embedding(emb),
                timeout,
                transfer_id=req.embedding_transfer_id,
            )
        except (BusError, ValueError) as e:
            return _failed(reply, bus_pb2.ERROR_CODE_UNAVAILABLE, f"embedding push failed: {e}")
        reply.embedding_ref.CopyFrom(ref)
        return reply

    async def hand_back(self) -> None:
        # Encodes still waiting for their image fail now, with a reply, rather than
        # holding the bus drain until their own timeout.
        if self.blobs is not None:
            await self.blobs.close()

    async def release(self) -> None:
        if self.blobs is not None:
            await self.blobs.close()  # safe twice: in case the drain failed before hand_back
        if self.store is not None:
            await self.store.close()


def _failed(reply: bus_pb2.EncodeReply, code: int, message: str) -> bus_pb2.EncodeReply:
    reply.error.CopyFrom(error(code, message))
    return reply
