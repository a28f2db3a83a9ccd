"""Conversions between engine objects and bus messages, shared by every service."""

from __future__ import annotations

import json

from protos.epd_pb import bus_pb2
from protos.epd_pb import inference_pb2 as pb
from services.engine.request import ImageSpan
from services.models.image_grid import ImageOptions
from services.outputs import Logprob, TokenLogprobs
from services.sampling_params import SamplingParams
from services.structured.outputs import StructuredOutputs

_SCALARS = (
    "top_k",
    "min_p",
    "presence_penalty",
    "frequency_penalty",
    "min_tokens",
    "ignore_eos",
    "temperature",
    "top_p",
    "repetition_penalty",
)

FINISH_TO_PROTO = {
    None: pb.FINISH_REASON_UNSPECIFIED,
    "stop": pb.FINISH_REASON_STOP,
    "length": pb.FINISH_REASON_LENGTH,
    "abort": pb.FINISH_REASON_ABORT,
    "error": pb.FINISH_REASON_ERROR,
}
FINISH_FROM_PROTO = {v: k for k, v in FINISH_TO_PROTO.items()}

# Bus error codes -> grpc.StatusCode names.
STATUS = {
    bus_pb2.ERROR_CODE_INVALID_ARGUMENT: "INVALID_ARGUMENT",
    bus_pb2.ERROR_CODE_NOT_FOUND: "NOT_FOUND",
    bus_pb2.ERROR_CODE_DEADLINE_EXCEEDED: "DEADLINE_EXCEEDED",
    bus_pb2.ERROR_CODE_RESOURCE_EXHAUSTED: "RESOURCE_EXHAUSTED",
    bus_pb2.ERROR_CODE_UNAVAILABLE: "UNAVAILABLE",
    bus_pb2.ERROR_CODE_ABORTED: "ABORTED",
    bus_pb2.ERROR_CODE_INTERNAL: "INTERNAL",
}


def error(code: int, message: str) -> bus_pb2.Error:
    return bus_pb2.Error(code=code, message=message)


def params_to_proto(sp: SamplingParams) -> pb.SamplingParams:
    msg = pb.SamplingParams(
        **{k: getattr(sp, k) for k in _SCALARS},
        stop_token_ids=sp.stop_token_ids,
        stop=sp.stop,
        skip_special_tokens=sp.skip_special_tokens,
        detokenize=sp.detokenize,
        reasoning_end_token_ids=sp.reasoning_end_token_ids,
    )
    for name in ("seed", "max_tokens", "logprobs", "n", "thinking_token_budget"):
        if getattr(sp, name) is not None:
            setattr(msg, name, getattr(sp, name))
    if sp.structured_outputs is not None:
        msg.structured_outputs.CopyFrom(constraint_to_proto(sp.structured_outputs))
    return msg


def constraint_to_proto(so: StructuredOutputs) -> pb.StructuredOutputs:
    msg = _kind_to_proto(so)
    msg.reasoning_end = so.reasoning_end or ""
    return msg


def _kind_to_proto(so: StructuredOutputs) -> pb.StructuredOutputs:
    if so.json is not None:
        text = so.json if isinstance(so.json, str) else json.dumps(so.json)
        return pb.StructuredOutputs(json=text)
    if so.structural_tag is not None:
        return pb.StructuredOutputs(structural_tag=json.dumps(so.structural_tag))
    if so.choice is not None:
        return pb.StructuredOutputs(choice=pb.Choices(items=list(so.choice)))
    if so.json_object:
        return pb.StructuredOutputs(json_object=True)
    if so.regex is not None:
        return pb.StructuredOutputs(regex=so.regex)
    return pb.StructuredOutputs(grammar=so.grammar)


def constraint_from_proto(msg: pb.StructuredOutputs) -> dict | None:
    """The ``structured_outputs`` object of a message (None: no constraint)."""
    kind = msg.WhichOneof("kind")
    if kind is None:
        return None
    value = list(msg.choice.items) if kind == "choice" else getattr(msg, kind)
    return {kind: value, "reasoning_end": msg.reasoning_end or None}


def params_kwargs(msg: pb.SamplingParams) -> dict:
    """SamplingParams keyword arguments; unset optional fields keep the defaults."""
    kw = {
        k: getattr(msg, k)
        for k in _SCALARS
        if k not in ("temperature", "top_p", "repetition_penalty")
    }
    for name in (
        "temperature",
        "top_p",
        "repetition_penalty",
        "seed",
        "max_tokens",
        "logprobs",
        "skip_special_tokens",
        "detokenize",
        "n",
        "thinking_token_budget",
    ):
        if msg.HasField(name):
            kw[name] = getattr(msg, name)
    if msg.HasField("structured_outputs"):
        kw["structured_outputs"] = constraint_from_proto(msg.structured_outputs)
    return dict(
        kw,
        stop=list(msg.stop),
        stop_token_ids=list(msg.stop_token_ids),
        reasoning_end_token_ids=list(msg.reasoning_end_token_ids),
    )


def params_from_proto(msg: pb.SamplingParams) -> SamplingParams:
    """Raises ValueError when the parameters are out of bounds."""
    return SamplingParams(**params_kwargs(msg))


def logprobs_to_proto(lp: TokenLogprobs | None) -> bus_pb2.TokenLogprobs:
    if lp is None:
        return bus_pb2.TokenLogprobs()
    return bus_pb2.TokenLogprobs(
        logprob=lp.logprob,
        rank=lp.rank,
        top_token_ids=[t for t, _ in lp.top],
        top_logprobs=[v for _, v in lp.top],
    )


def logprobs_from_proto(token_id: int, msg: bus_pb2.TokenLogprobs) -> TokenLogprobs:
    top = list(zip(msg.top_token_ids, msg.top_logprobs, strict=True))
    return TokenLogprobs(token_id, msg.logprob, msg.rank or 1, top)


def logprobs_from_dict(token_id: int, d: dict[int, Logprob] | None, n: int) -> TokenLogprobs | None:
    """The engine's per-token logprob dict -> TokenLogprobs (chosen + top-n, best first)."""
    if d is None:
        return None
    top = sorted(
        (lp.rank, t, lp.logprob) for t, lp in d.items() if lp.rank is not None and lp.rank <= n
    )
    chosen = d[token_id]
    return TokenLogprobs(token_id, chosen.logprob, chosen.rank or 1, [(t, v) for _, t, v in top])


def options_to_proto(options: ImageOptions) -> bus_pb2.ImageOptions:
    return bus_pb2.ImageOptions(min_pixels=options.min_pixels, max_pixels=options.max_pixels)


def options_from_proto(msg: bus_pb2.ImageOptions) -> ImageOptions:
    """Checked as a request's mm_processor_kwargs are (ValueError when bad)."""
    return ImageOptions.of(
        {"min_pixels": msg.min_pixels or None, "max_pixels": msg.max_pixels or None}
    )


def spans_to_proto(spans: list[ImageSpan], keys: dict[str, str]) -> list[bus_pb2.ImageSpan]:
    return [
        bus_pb2.ImageSpan(
            offset=s.offset,
            length=s.length,
            image_hash=s.image_hash,
            embedding_key=keys.get(s.image_hash, ""),
            grid=list(s.grid),
        )
        for s in spans
    ]


def spans_from_proto(spans) -> list[ImageSpan]:
    """Received spans (checked against the prompt by ``InputProcessor.check_spans``)."""
    return [ImageSpan(s.offset, s.length, s.image_hash, tuple(s.grid)) for s in spans]
