"""The decode service: the engine in decode role.

Receives KV blocks on ``epd.kv.<id>`` and the ``DecodeRequest`` that adopts them on
``epd.decode.<id>``; batches every adopted request continuously; after each step sends
one ``TokenBatch`` per gateway with every request's new tokens.
"""

from __future__ import annotations

import logging

from protos.epd_pb import bus_pb2
from services.bus import subjects
from services.bus.codec import dtype_name, tensor_from_proto
from services.bus.deadline import remaining_s, timeout_for
from services.bus.errors import BusError
from services.config import EngineConfig, ServiceConfig
from services.engine.llm_engine import LLMEngine
from services.engine_service import EngineService
from services.kv_connector import NatsKVReceiver
from services.observability import bind_request
from services.wire import (
    FINISH_TO_PROTO,
    error,
    logprobs_from_dict,
    logprobs_from_proto,
    logprobs_to_proto,
    params_from_proto,
    spans_from_proto,
)

log = logging.getLogger(__name__)


class DecodeService(EngineService):
    role = subjects.ROLE_DECODE

    def __init__(self, engine_config: EngineConfig, config: ServiceConfig):
        super().__init__(engine_config, config)
        self.receiver = None
        self.step = 0
        # Requests adopted since start (a metric; tests check both instances get work).
        self.adopted = 0

    async def _register(self, llm: LLMEngine) -> None:
        # The pool's own rows: a quantized cache's carry their scales (kv_cache.row_width).
        pool = llm.kv.data
        layout = (
            llm.loaded.num_kv_layers,
            llm.config.block_size,
            llm.model.num_kv_heads,
            pool.shape[-1],
            dtype_name(pool.dtype),
        )
        self.receiver = NatsKVReceiver(self.bus, self.instance_id, layout)
        await self.receiver.start()
        # Served while draining: a hand-off continues a request admitted before the drain.
        adopt = self.answering(bus_pb2.DecodeRequest, bus_pb2.DecodeReply, self._adopt)
        await self.serve_work(
            subjects.decode(self.model_fingerprint, self.instance_id), adopt, while_draining=True
        )
        # Conditional disaggregation: a short text prompt prefills here, no KV transfer.
        here = self.answering(bus_pb2.PrefillRequest, bus_pb2.PrefillReply, self._prefill_here)
        await self.serve_work(
            subjects.prefill(self.model_fingerprint, self.instance_id), here, bus_pb2.PrefillReply
        )

    async def _prefill_here(self, req: bus_pb2.PrefillRequest) -> bus_pb2.Error | None:
        rid, llm = req.request_id, self.engine.engine
        bind_request(rid)
        if req.image_spans or req.decode_instance_id != self.instance_id:
            return error(
                bus_pb2.ERROR_CODE_INVALID_ARGUMENT,
                "a decode instance prefills only text prompts it decodes itself",
            )
        if rid in self.aborted:
            return error(bus_pb2.ERROR_CODE_ABORTED, f"request {rid} was aborted")
        self.routes[rid] = req
        try:
            params = params_from_proto(req.sampling)
            await self.engine.call(
                lambda: llm.add_request(
                    rid,
                    {"prompt_token_ids": list(req.prompt_token_ids)},
                    params,
                    resume=list(req.output_token_ids),
                )
            )
        except (ValueError, MemoryError) as e:
            self.routes.pop(rid, None)
            return error(bus_pb2.ERROR_CODE_INVALID_ARGUMENT, str(e))
        return None

    async def _adopt(self, req: bus_pb2.DecodeRequest) -> bus_pb2.Error | None:
        """Reserve the KV blocks, then take the transfer, then continue the request. Any
        refusal frees what was reserved and names its reason."""
        rid, llm = req.request_id, self.engine.engine
        bind_request(rid)
        try:
            params = params_from_proto(req.sampling)
            reserved = await self.engine.call(lambda: llm.reserve_import(rid, len(req.token_ids)))
        except ValueError as e:
            self.receiver.refuse(req.kv_transfer_id, str(e))
            return error(bus_pb2.ERROR_CODE_INVALID_ARGUMENT, str(e))
        if not reserved:
            self.receiver.refuse(req.kv_transfer_id, "no free KV blocks")
            return error(
                bus_pb2.ERROR_CODE_RESOURCE_EXHAUSTED,
                f"decode {self.instance_id} has no room for {len(req.token_ids)} tokens of KV",
            )
        problem = await self._import(req, params)
        if problem is not None:
            await self.engine.call(lambda: llm.release_import(rid))
        return problem

    async def _import(self, req: bus_pb2.DecodeRequest, params) -> bus_pb2.Error | None:
        rid, llm = req.request_id, self.engine.engine
        try:
            timeout = timeout_for(req.deadline_unix_ms, "KV receive", self.config.bus_timeout_s)
            header, kv = await self.receiver.receive(req.kv_transfer_id, timeout)
            if (header.request_id, header.num_tokens) != (rid, len(req.token_ids)):
                raise ValueError(
                    f"KV of {header.request_id} ({header.num_tokens} tokens) does "
                    f"not belong to {rid} ({len(req.token_ids)} tokens)"
                )
        except BusError as e:
            return error(bus_pb2.ERROR_CODE_UNAVAILABLE, f"KV transfer failed: {e}")
        except ValueError as e:
            return error(bus_pb2.ERROR_CODE_INVALID_ARGUMENT, str(e))
        if rid in self.aborted:
            return error(bus_pb2.ERROR_CODE_ABORTED, f"request {rid} was aborted")
        first_lp = None
        if req.HasField("first_logprobs") and params.logprobs is not None:
            first_lp = logprobs_from_proto(req.first_token_id, req.first_logprobs)
        self.routes[rid] = req
        try:
            aux = tensor_from_proto(req.aux_hidden) if req.HasField("aux_hidden") else None
            await self.engine.call(
                lambda: llm.import_request(
                    rid,
                    list(req.token_ids),
                    req.num_prompt_tokens,
                    req.first_token_id,
                    params,
                    kv,
                    first_lp,
                    aux,
                    spans_from_proto(req.image_spans),
                )
            )
        except (ValueError, MemoryError) as e:
            self.routes.pop(rid, None)
            return error(bus_pb2.ERROR_CODE_INVALID_ARGUMENT, str(e))
        self.adopted += 1
        log.debug("decode adopted: %d tokens of KV from %s", len(req.token_ids), req.kv_transfer_id)
        return None

    def _on_outputs(self, outputs) -> None:
        """One TokenBatch per gateway per engine step."""
        self.step += 1
        batches: dict[str, bus_pb2.TokenBatch] = {}
        for out in outputs:
            req = self.routes.get(out.request_id)
            if req is None:
                continue
            upd = self._update(req, out)
            if not out.finished and req.deadline_unix_ms and remaining_s(req.deadline_unix_ms) <= 0:
                # Past its deadline the gateway has given up: stop spending steps on it.
                upd.error.CopyFrom(
                    error(bus_pb2.ERROR_CODE_DEADLINE_EXCEEDED, "the request ran past its deadline")
                )
                self._spawn(self.engine.abort(out.request_id))
            if out.finished or upd.HasField("error"):
                self.routes.pop(out.request_id, None)
            batch = batches.setdefault(
                req.gateway_id, bus_pb2.TokenBatch(instance_id=self.instance_id, step=self.step)
            )
            batch.updates.append(upd)
        for gateway_id, batch in batches.items():
            self._spawn(self.bus.publish(subjects.out(gateway_id), batch))

    @staticmethod
    def _update(req: bus_pb2.DecodeRequest | bus_pb2.PrefillRequest, out) -> bus_pb2.TokenUpdate:
        comp = out.outputs[0]
        new = comp.token_ids_delta
        upd = bus_pb2.TokenUpdate(
            request_id=req.request_id,
            token_ids=new,
            offset=len(comp.token_ids) - len(new),
            num_cached_tokens=out.num_cached_tokens,
            finish_reason=FINISH_TO_PROTO[comp.finish_reason],
        )
        if comp.logprobs is not None:
            n = req.sampling.logprobs if req.sampling.HasField("logprobs") else 0
            tail = comp.logprobs[len(comp.token_ids) - len(new) :]
            upd.logprobs.extend(
                logprobs_to_proto(logprobs_from_dict(t, d, n))
                for t, d in zip(new, tail, strict=False)
            )
        if isinstance(comp.stop_reason, int):
            upd.stop_token_id = comp.stop_reason
        if out.error:
            upd.error.CopyFrom(error(bus_pb2.ERROR_CODE_INTERNAL, out.error))
        return upd

    async def hand_back(self) -> None:
        await self._fail_in_flight("the decode instance is shutting down")
        if self.receiver is not None:
            await self.receiver.close()
