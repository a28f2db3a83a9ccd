"""After a verification step: count the emitted tokens, roll back rejected drafts' slots.

Torch-free, like the scheduler that calls it. A step computed ``num_new_tokens`` tokens
of the request; the last ``k`` of them were drafts. The tokens the request emits are the
accepted drafts and then the target's own token (spec/verify.py); the KV of the request's
last known token and of the accepted drafts is valid, the rest is garbage in slots
nobody reads. The request ends the step in exactly the state a run without drafts would
have reached token by token: ``num_computed_tokens = num_tokens - 1``, blocks covering
only computed tokens, prefix-cache hashes only over accepted tokens.
"""

from __future__ import annotations

from services.engine.block_manager import BlockManager
from services.engine.request import RequestStatus
from services.engine.scheduler_output import ScheduledRequest
from services.engine.stopping import stop_status

Stop = tuple[RequestStatus, int | None]


def settle_step(
    bm: BlockManager, item: ScheduledRequest, tokens: list[int] | None
) -> tuple[list[int], Stop | None]:
    """Apply one request's step result: (tokens kept, stop status or None).

    ``tokens``: what the runner emitted for it (None or [] when it did not sample; in
    a multi-step burst, one per step, each step's KV computed before the next). Appends the tokens one at a time and checks the stop rules after each, as that
    many plain decode steps would; a stop inside the accepted drafts drops the rest.
    """
    request = item.request
    num_drafts = len(item.draft_token_ids)
    # Known tokens computed this step: all but the drafts.
    request.num_computed_tokens = item.end - num_drafts
    kept: list[int] = []
    stop = None
    for token in (tokens or []) if item.sample else []:
        if kept:  # the previous token was an accepted draft: its KV is valid
            request.num_computed_tokens += 1
        request.append_output_token(token)
        kept.append(token)
        if (stop := stop_status(request)) is not None:
            break
    bm.cache_full_blocks(request, request.num_computed_tokens)
    if num_drafts and stop is None:
        bm.free_tail(request, request.num_computed_tokens)
    return kept, stop
