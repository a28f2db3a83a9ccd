"""After prefill: tell the gateway the first token, then hand the request to decode."""

from __future__ import annotations

import asyncio
import logging
import time
import uuid

from protos.epd_pb import bus_pb2
from services.bus import subjects
from services.bus.codec import tensor_to_proto
from services.bus.connection import Bus
from services.bus.deadline import timeout_for
from services.bus.errors import BusError
from services.kv_connector import KVSender
from services.metrics import KV_BYTES_SENT, KV_TRANSFER_SECONDS
from services.observability import bind_request
from services.outputs import RequestOutput
from services.wire import FINISH_TO_PROTO, STATUS, error, logprobs_from_dict, logprobs_to_proto

log = logging.getLogger(__name__)


class HandOffError(Exception):
    def __init__(self, err: bus_pb2.Error):
        super().__init__(err.message)
        self.err = err


def first_token_update(req: bus_pb2.PrefillRequest, out: RequestOutput) -> bus_pb2.TokenUpdate:
    """The first new token (or the failure) as the gateway expects it: offset 0, or the
    number of tokens the client already has when the request was migrated."""
    comp = out.outputs[0]
    new = comp.token_ids_delta[:1]
    offset = len(comp.token_ids) - len(comp.token_ids_delta)
    upd = bus_pb2.TokenUpdate(
        request_id=req.request_id,
        token_ids=new,
        offset=offset,
        num_cached_tokens=out.num_cached_tokens,
        finish_reason=FINISH_TO_PROTO[comp.finish_reason],
    )
    if comp.logprobs and new:
        n = req.sampling.logprobs if req.sampling.HasField("logprobs") else 0
        upd.logprobs.append(logprobs_to_proto(logprobs_from_dict(new[0], comp.logprobs[offset], n)))
    if isinstance(comp.stop_reason, int):
        upd.stop_token_id = comp.stop_reason
    if out.error:
        upd.error.CopyFrom(error(bus_pb2.ERROR_CODE_INTERNAL, out.error))
    return upd


class HandOff:
    def __init__(
        self, bus: Bus, sender: KVSender, instance_id: str, timeout_s: float, model_fingerprint: str
    ):
        self.bus = bus
        # Decode instances of this model only (epd.decode.<fp>.<id>).
        self.model_fingerprint = model_fingerprint
        self.sender = sender
        self.instance_id = instance_id
        self.timeout_s = timeout_s

    async def hand_over(
        self, req: bus_pb2.PrefillRequest, upd: bus_pb2.TokenUpdate, kv, aux_hidden=None
    ) -> None:
        """Ship the KV and the DecodeRequest (with a draft head's hidden rows, if any); on
        failure the gateway gets a clear error."""
        bind_request(req.request_id)  # this task's log lines are about that request
        try:
            await self._send(req, upd, kv, aux_hidden)
        except (BusError, HandOffError, ValueError, OSError) as e:
            code = e.err.code if isinstance(e, HandOffError) else bus_pb2.ERROR_CODE_UNAVAILABLE
            log.warning(
                "hand-off of %s to %s failed: %s", req.request_id, req.decode_instance_id, e
            )
            fail = bus_pb2.TokenUpdate(
                request_id=req.request_id,
                offset=upd.offset + 1,
                finish_reason=FINISH_TO_PROTO["error"],
            )
            fail.error.CopyFrom(
                error(
                    code,
                    f"hand-off to decode instance {req.decode_instance_id} "
                    f"failed ({STATUS.get(code, 'UNAVAILABLE')}): {e}",
                )
            )
            batch = bus_pb2.TokenBatch(instance_id=self.instance_id, updates=[fail])
            await self.bus.publish(subjects.out(req.gateway_id), batch)

    async def _send(
        self, req: bus_pb2.PrefillRequest, upd: bus_pb2.TokenUpdate, kv, aux_hidden=None
    ) -> None:
        """KV and DecodeRequest go out together: decode waits for the transfer itself, so
        the hand-off costs one transfer, not a transfer plus a round trip. A decode
        instance without room for the blocks refuses before it takes the transfer: the
        send stops at once and the gateway routes the request elsewhere."""
        tid = f"{req.request_id}-{uuid.uuid4().hex[:8]}"
        timeout = timeout_for(req.deadline_unix_ms, "KV transfer", self.timeout_s)
        adopt = asyncio.create_task(
            self.bus.request(
                subjects.decode(self.model_fingerprint, req.decode_instance_id),
                self._decode_request(req, upd, tid, aux_hidden),
                bus_pb2.DecodeReply,
                timeout,
            )
        )
        num_tokens = len(req.prompt_token_ids) + len(req.output_token_ids)
        send = asyncio.create_task(
            self.sender.send(req.decode_instance_id, tid, req.request_id, kv, num_tokens, timeout)
        )
        start = time.perf_counter()
        try:
            done, _ = await asyncio.wait({adopt, send}, return_when=asyncio.FIRST_COMPLETED)
            if adopt in done and send not in done and adopt.result().HasField("error"):
                raise HandOffError(adopt.result().error)  # refused before the transfer
            nbytes = await send
            KV_BYTES_SENT.inc(nbytes)
            KV_TRANSFER_SECONDS.observe(time.perf_counter() - start)
            reply = await adopt
        except BaseException:
            adopt.cancel()
            send.cancel()
            raise
        if reply.HasField("error"):
            raise HandOffError(reply.error)

    @staticmethod
    def _decode_request(
        req: bus_pb2.PrefillRequest, upd: bus_pb2.TokenUpdate, tid: str, aux_hidden=None
    ):
        dreq = bus_pb2.DecodeRequest(
            request_id=req.request_id,
            gateway_id=req.gateway_id,
            token_ids=[*req.prompt_token_ids, *req.output_token_ids],
            num_prompt_tokens=len(req.prompt_token_ids),
            first_token_id=upd.token_ids[0],
            sampling=req.sampling,
            kv_transfer_id=tid,
            deadline_unix_ms=req.deadline_unix_ms,
            eos_token_ids=req.eos_token_ids,
            max_model_len=req.max_model_len,
            image_spans=req.image_spans,
        )
        if upd.logprobs:
            dreq.first_logprobs.CopyFrom(upd.logprobs[0])
        if aux_hidden is not None:  # one row: small next to the message limit
            dreq.aux_hidden.CopyFrom(tensor_to_proto(aux_hidden))
        return dreq
