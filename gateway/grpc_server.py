"""The public gRPC API (``epd.v1.Inference``), with health and reflection services."""

from __future__ import annotations

import asyncio
import json
import logging
import time

import grpc
from google.protobuf.message import DecodeError
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from gateway.chat_output import ChatOptions, earlier_call
from gateway.core import GatewayCore
from gateway.errors import classify
from gateway.models import ModelSet
from gateway.prepare import InvalidRequest, PreparedRequest
from gateway.semantic_router.router import GuardBlocked
from gateway.stream import Delta, OutputStream
from protos.epd_pb import inference_pb2 as pb
from protos.epd_pb import inference_pb2_grpc as pb_grpc
from services.wire import FINISH_TO_PROTO, params_kwargs

log = logging.getLogger(__name__)


def _messages(chat: pb.Chat) -> list[dict]:
    out = []
    for m in chat.messages:
        msg = {"role": m.role, **_tool_fields(m)}
        if not m.parts:
            out.append({**msg, "content": m.content})
            continue
        parts = []
        for p in m.parts:
            if p.WhichOneof("part") == "image":
                parts.append({"type": "image", "image": p.image})
            else:
                parts.append({"type": "text", "text": p.text})
        out.append({**msg, "content": parts})
    return out


def _tool_fields(m: pb.ChatMessage) -> dict:
    out = {k: getattr(m, k) for k in ("tool_call_id", "name") if getattr(m, k)}
    if m.tool_calls:
        out["tool_calls"] = [earlier_call(c.id, c.name, c.arguments) for c in m.tool_calls]
    return out


def _json_field(text: str, param: str):
    try:
        return json.loads(text)
    except ValueError as e:
        raise InvalidRequest(f"{param} is not valid JSON: {e}", param) from e


def _chat_options(chat: pb.Chat) -> ChatOptions:
    """The request's tools and template keywords, validated as over REST."""
    tools = [
        {
            "type": "function",
            "function": {
                "name": t.name,
                "description": t.description,
                "parameters": _json_field(t.parameters, "tools") if t.parameters else {},
            },
        }
        for t in chat.tools
    ]
    kwargs = chat.chat_template_kwargs
    kwargs = _json_field(kwargs, "chat_template_kwargs") if kwargs else {}
    if not isinstance(kwargs, dict):
        raise InvalidRequest("chat_template_kwargs must be a JSON object", "chat_template_kwargs")
    choice = chat.tool_choice or None
    if choice not in (None, "none", "auto", "required"):
        choice = {"type": "function", "function": {"name": choice}}
    return ChatOptions.of(
        tools,
        choice,
        chat.parallel_tool_calls if chat.HasField("parallel_tool_calls") else True,
        kwargs,
        chat.thinking_token_budget if chat.HasField("thinking_token_budget") else None,
    )


def _answer(prep: PreparedRequest, text: str) -> pb.ChatAnswer | None:
    """A chat choice read back by the request's parsers (None: not a chat)."""
    if prep.messages is None:
        return None
    message, _ = prep.parsers.message(text)
    calls = [
        pb.ToolCall(id=c["id"], name=c["function"]["name"], arguments=c["function"]["arguments"])
        for c in message.get("tool_calls", ())
    ]
    return pb.ChatAnswer(
        content=message["content"] or "", reasoning=message.get("reasoning") or "", tool_calls=calls
    )


def _cache_metadata(prep: PreparedRequest) -> tuple:
    """x-epd-cache (hit-exact, hit-semantic, miss) and the semantic router's x-epd-model,
    x-epd-route and x-epd-guard, as over REST."""
    meta = (("x-epd-cache", prep.cache_status), *prep.route_headers.items())
    if prep.cache_similarity is not None:
        meta += (("x-epd-cache-similarity", f"{prep.cache_similarity:.4f}"),)
    return meta


def _echo(prep: PreparedRequest) -> str:
    """The id a response carries: the client's own when it sent one."""
    return prep.client_request_id if prep.client_request_id is not None else prep.request_id


def _logprobs(tokenizer, delta_lps) -> list[pb.TokenLogprob]:
    out = []
    for lp in delta_lps:
        if lp is None:
            continue
        top = [pb.TopLogprob(token_id=t, text=tokenizer.decode([t]), logprob=v) for t, v in lp.top]
        out.append(
            pb.TokenLogprob(
                token_id=lp.token_id,
                text=tokenizer.decode([lp.token_id]),
                logprob=lp.logprob,
                top_logprobs=top,
            )
        )
    return out


async def _abort_with_status(context, request_id: str, e: Exception) -> None:
    failure = classify(e, request_id)
    if isinstance(e, GuardBlocked):  # the refusal says which guard, as over REST
        context.set_trailing_metadata(tuple(e.headers.items()))
    await context.abort(getattr(grpc.StatusCode, failure.code), failure.message)


def usage(prep: PreparedRequest, streams: list[OutputStream]) -> pb.Usage:
    """Token counts of the whole request (every choice)."""
    return pb.Usage(
        prompt_tokens=len(prep.prompt_token_ids),
        completion_tokens=sum(len(s.token_ids) for s in streams),
        cached_tokens=max(s.num_cached_tokens for s in streams),
    )


class InferenceServicer(pb_grpc.InferenceServicer):
    """Each call runs on the core its ``model`` resolves to (gateway/models.py)."""

    def __init__(self, served: GatewayCore | ModelSet):
        self.models = ModelSet.of(served)

    async def _prepare(
        self, request: pb.GenerateRequest, context
    ) -> tuple[GatewayCore, PreparedRequest]:
        which = request.WhichOneof("input")
        meta = {k: v for k, v in context.invocation_metadata() or () if isinstance(v, str)}
        mode = "bypass" if request.cache_opt_out else meta.get("x-epd-cache", "default").lower()
        try:
            chat = _chat_options(request.chat) if which == "chat" else None
            core, prep = await self.models.prepare(
                model=request.model,
                chat=chat,
                params=params_kwargs(request.sampling),
                messages=_messages(request.chat) if which == "chat" else None,
                prompt=request.prompt if which == "prompt" else None,
                prompt_token_ids=list(request.prompt_token_ids.ids)
                if which == "prompt_token_ids"
                else None,
                images=list(request.images),
                request_id=request.request_id if request.HasField("request_id") else None,
                cache_opt_out=request.cache_opt_out,
                cache_mode=mode,
                tenant=meta.get("x-epd-user", ""),
                session_key=meta.get("x-session-id") or meta.get("x-epd-user", ""),
                mm_processor_kwargs=_json_field(request.mm_processor_kwargs, "mm_processor_kwargs")
                if request.mm_processor_kwargs
                else None,
            )
        except Exception as e:
            await _abort_with_status(context, "", e)
        left = context.time_remaining()
        if left is not None:  # the client's own deadline, when sooner, binds every hop
            prep.deadline = min(prep.deadline, time.time() + left)
        return core, prep

    def _response(self, core, prep, delta: Delta, streams) -> pb.GenerateResponse:
        resp = pb.GenerateResponse(
            request_id=_echo(prep),
            token_ids=delta.token_ids,
            text=delta.text,
            logprobs=_logprobs(core.tokenizer, delta.logprobs),
            finish_reason=FINISH_TO_PROTO[delta.finish_reason],
            model=core.info.model_id,
            index=delta.index,
            answer=_answer(prep, streams[delta.index].text) if delta.finish_reason else None,
        )
        if all(s.finished for s in streams):
            resp.usage.CopyFrom(usage(prep, streams))
        return resp

    async def Generate(self, request, context):  # noqa: N802 - gRPC method name
        core, prep = await self._prepare(request, context)
        try:
            first = True
            async for delta, streams in core.run(prep):
                if first:  # the cache lookup is done by the first delta
                    await context.send_initial_metadata(_cache_metadata(prep))
                    first = False
                yield self._response(core, prep, delta, streams)
        except Exception as e:  # errors are values at the edge: always a status
            await _abort_with_status(context, prep.request_id, e)

    async def GenerateOnce(self, request, context):  # noqa: N802
        core, prep = await self._prepare(request, context)
        streams = []
        try:
            async for _, streams in core.run(prep):  # noqa: B007 - the last one counts
                pass
        except Exception as e:
            await _abort_with_status(context, prep.request_id, e)
        await context.send_initial_metadata(_cache_metadata(prep))
        tok = core.tokenizer
        choices = [
            pb.Choice(
                index=s.index,
                token_ids=s.token_ids,
                text=s.text,
                logprobs=_logprobs(tok, s.logprobs),
                finish_reason=FINISH_TO_PROTO[s.state.finish_reason],
                answer=_answer(prep, s.text),
            )
            for s in streams
        ]
        first = choices[0]
        return pb.GenerateResult(
            request_id=_echo(prep),
            token_ids=first.token_ids,
            text=first.text,
            logprobs=first.logprobs,
            finish_reason=first.finish_reason,
            usage=usage(prep, streams),
            model=core.info.model_id,
            choices=choices,
            answer=first.answer if first.HasField("answer") else None,
        )

    async def ListModels(self, request, context):  # noqa: N802
        """The models that have live instances now."""
        now = int(time.time())
        models = [
            pb.ModelInfo(
                id=c.info.model_id,
                owned_by="epd-serve",
                created=now,
                max_model_len=c.info.max_model_len,
                vision=c.info.vision,
            )
            for c in self.models.live()
        ]
        return pb.ListModelsResponse(models=models)


def _parsed(method, msg_type, streaming: bool):
    """Parse the request ourselves: undecodable bytes get INVALID_ARGUMENT, not INTERNAL."""

    async def parse(raw: bytes, context):
        try:
            return msg_type.FromString(raw)
        except DecodeError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"malformed request: {e}")

    if streaming:

        async def stream(raw, context):
            async for resp in method(await parse(raw, context), context):
                yield resp

        return stream

    async def unary(raw, context):
        return await method(await parse(raw, context), context)

    return unary


def _inference_handlers(servicer: InferenceServicer):
    raw = lambda b: b  # noqa: E731 - identity deserializer
    ser = lambda m: m.SerializeToString()  # noqa: E731
    handlers = {
        "Generate": grpc.unary_stream_rpc_method_handler(
            _parsed(servicer.Generate, pb.GenerateRequest, True), raw, ser
        ),
        "GenerateOnce": grpc.unary_unary_rpc_method_handler(
            _parsed(servicer.GenerateOnce, pb.GenerateRequest, False), raw, ser
        ),
        "ListModels": grpc.unary_unary_rpc_method_handler(
            _parsed(servicer.ListModels, pb.ListModelsRequest, False), raw, ser
        ),
    }
    return grpc.method_handlers_generic_handler("epd.v1.Inference", handlers)


async def track_health(health_servicer, served: GatewayCore | ModelSet, period_s: float) -> None:
    """SERVING only while some model's backend can take requests (workers alive, engine
    running)."""
    models = ModelSet.of(served)
    name = pb.DESCRIPTOR.services_by_name["Inference"].full_name
    serving, not_serving = (
        health_pb2.HealthCheckResponse.SERVING,
        health_pb2.HealthCheckResponse.NOT_SERVING,
    )
    while True:
        status = serving if models.ready() else not_serving
        for service in ("", name):
            await health_servicer.set(service, status)
        await asyncio.sleep(period_s)


async def start_grpc_server(served: GatewayCore | ModelSet, host: str, port: int):
    """Serve Inference + grpc.health.v1 + reflection; returns (server, bound port, health)."""
    server = grpc.aio.server(options=[("grpc.max_receive_message_length", 64 << 20)])
    server.add_generic_rpc_handlers((_inference_handlers(InferenceServicer(served)),))
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    names = (
        pb.DESCRIPTOR.services_by_name["Inference"].full_name,
        health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
        reflection.SERVICE_NAME,
    )
    reflection.enable_server_reflection(names, server)
    bound = server.add_insecure_port(f"{host}:{port}")
    await server.start()
    return server, bound, health_servicer
