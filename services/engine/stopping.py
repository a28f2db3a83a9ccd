"""When a request stops: the rules the scheduler applies after every token (torch-free)."""

from __future__ import annotations

from services.engine.request import Request, RequestStatus


def stop_status(request: Request) -> tuple[RequestStatus, int | None] | None:
    """(status, stop_reason) if the request must stop after its last token."""
    params = request.sampling_params
    if request.num_output_tokens >= params.min_tokens and request.output_token_ids:
        last = request.output_token_ids[-1]
        if not params.ignore_eos and last in request.eos_token_ids:
            return RequestStatus.FINISHED_STOPPED, None
        if last in params.stop_token_ids:
            return RequestStatus.FINISHED_STOPPED, last
    # max_total_tokens folds max_tokens and max_model_len; min_tokens <= max_tokens, so
    # only the context length can cut a request short of min_tokens.
    if request.num_tokens >= request.max_total_tokens:
        return RequestStatus.FINISHED_LENGTH, None
    return None


def check_stop(request: Request) -> RequestStatus | None:
    """The finished status the request reaches with its last token, or None to go on.

    EOS (unless ignore_eos) and ``stop_token_ids`` stop it once ``min_tokens`` outputs
    exist; ``max_tokens`` and the context length end it whatever min_tokens says.
    """
    result = stop_status(request)
    return None if result is None else result[0]
