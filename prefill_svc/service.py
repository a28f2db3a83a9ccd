"""The prefill service: the engine in prefill role.

Takes ``PrefillRequest`` on ``epd.prefill.<fp>.<id>``, reads image embeddings from Redis,
runs the prompt (prefix cache, chunked prefill), publishes the first token straight to
the gateway (TTFT does not wait for the KV transfer), then ships the prompt's KV blocks
to the decode instance named in the request and hands the request over.
"""

from __future__ import annotations

import logging

from prefill_svc.handoff import HandOff, first_token_update
from protos.epd_pb import bus_pb2
from services.bus import subjects
from services.bus.blobs import BlobInbox
from services.bus.deadline import remaining_s, timeout_for
from services.bus.errors import BusError
from services.config import EngineConfig, ServiceConfig
from services.embeddings.store import EmbeddingStore, EmbeddingStoreConfig, unpack_embedding
from services.engine.llm_engine import LLMEngine
from services.engine_service import EngineService
from services.kv_connector import NatsKVSender
from services.observability import bind_request
from services.wire import error, params_from_proto, spans_from_proto

log = logging.getLogger(__name__)


class PrefillService(EngineService):
    role = subjects.ROLE_PREFILL

    def __init__(self, engine_config: EngineConfig, config: ServiceConfig):
        super().__init__(engine_config, config)
        self.store = self.blobs = None

    async def _register(self, llm: LLMEngine) -> None:
        self.store = EmbeddingStore.from_config(EmbeddingStoreConfig(url=self.config.redis_url))
        self.blobs = BlobInbox(self.bus, self.instance_id, self.config.max_blob_mb << 20)
        await self.blobs.start()
        self.handoff = HandOff(
            self.bus,
            NatsKVSender(self.bus),
            self.instance_id,
            self.config.bus_timeout_s,
            self.model_fingerprint,
        )
        admit = self.answering(bus_pb2.PrefillRequest, bus_pb2.PrefillReply, self._admit)
        await self.serve_work(
            subjects.prefill(self.model_fingerprint, self.instance_id), admit, bus_pb2.PrefillReply
        )

    async def _admit(self, req: bus_pb2.PrefillRequest) -> bus_pb2.Error | None:
        rid = req.request_id
        bind_request(rid)
        if rid in self.aborted or remaining_s(req.deadline_unix_ms) <= 0:
            return error(
                bus_pb2.ERROR_CODE_ABORTED, f"request {rid} was aborted or is past its deadline"
            )
        try:
            params = params_from_proto(req.sampling)
            embeds = await self._embeddings(req)
        except ValueError as e:
            return error(bus_pb2.ERROR_CODE_INVALID_ARGUMENT, str(e))
        except LookupError as e:  # the gateway has it encoded again and pushed here
            return error(bus_pb2.ERROR_CODE_NOT_FOUND, str(e))
        prompt = {
            "prompt_token_ids": list(req.prompt_token_ids),
            "image_spans": spans_from_proto(req.image_spans),
        }
        self.routes[rid] = req
        llm = self.engine.engine
        try:
            await self.engine.call(
                lambda: llm.add_request(
                    rid,
                    prompt,
                    params,
                    image_embeds=embeds,
                    export_kv=True,
                    resume=list(req.output_token_ids),
                )
            )
        except (ValueError, MemoryError) as e:
            self.routes.pop(rid, None)
            return error(bus_pb2.ERROR_CODE_INVALID_ARGUMENT, str(e))
        log.debug(
            "prefill admitted: %d prompt tokens, %d images, decode on %s",
            len(req.prompt_token_ids),
            len(req.image_spans),
            req.decode_instance_id,
        )
        return None

    async def _embeddings(self, req: bus_pb2.PrefillRequest) -> list:
        """Each span's embedding (Redis, or a blob the encoder sent here), checked
        against the model: rows = the span's placeholders, columns = its embedding width."""
        out = []
        llm = self.engine.engine
        fingerprint, hidden = llm.loaded.fingerprint, llm.loaded.image_embedding_width
        for span in req.image_spans:
            if span.HasField("embedding_ref"):
                emb = await self._pushed_embedding(req, span)
            else:
                emb = await self.store.get(fingerprint, span.image_hash)
            if emb is None:
                raise LookupError(f"embedding of image {span.image_hash[:12]} is not in the cache")
            if (
                emb.dim() != 2
                or list(emb.shape) != [span.length, hidden]
                or not emb.is_floating_point()
            ):
                raise ValueError(
                    f"embedding of image {span.image_hash[:12]} is {emb.dtype} "
                    f"{list(emb.shape)}, expected floats [{span.length}, {hidden}]"
                )
            # Cast here, per request: a peer's float64 tensor must not reach the batched
            # forward, where it would fail every request in the step.
            out.append(emb.to(llm.loaded.dtype))
        return out

    async def _pushed_embedding(self, req: bus_pb2.PrefillRequest, span):
        try:
            timeout = timeout_for(
                req.deadline_unix_ms, "embedding receive", self.config.bus_timeout_s
            )
            data = await self.blobs.take(span.embedding_ref, timeout)
        except BusError as e:
            raise LookupError(
                f"embedding of image {span.image_hash[:12]} did not arrive: {e}"
            ) from e
        return unpack_embedding(bytes(data))

    def _on_outputs(self, outputs) -> None:
        """One TokenBatch per gateway with this step's first tokens, then the hand-offs."""
        batches: dict[str, bus_pb2.TokenBatch] = {}
        for out in outputs:
            req = self.routes.pop(out.request_id, None)
            if req is None:
                continue
            upd = first_token_update(req, out)
            batch = batches.setdefault(
                req.gateway_id, bus_pb2.TokenBatch(instance_id=self.instance_id)
            )
            batch.updates.append(upd)
            if out.outputs[0].finish_reason is None and out.kv_blocks is not None:
                self._spawn(
                    self.handoff.hand_over(req, upd, out.kv_blocks, out.aux_hidden), owner=req
                )
        for gateway_id, batch in batches.items():
            self._spawn(self.bus.publish(subjects.out(gateway_id), batch))

    async def release(self) -> None:
        await super().release()
        if self.blobs is not None:
            await self.blobs.close()
        if self.store is not None:
            await self.store.close()
