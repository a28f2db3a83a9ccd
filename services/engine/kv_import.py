"""Decode role: requests whose KV was computed elsewhere (a prefill instance).

Blocks are reserved **before** the transfer is accepted (``reserve``), so a decode
instance without room refuses at once and the router picks another one instead of
receiving megabytes it cannot place; ``adopt`` then fills the reserved blocks. Any
failure in between gives the blocks back (``release``): nothing leaks.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import torch

from services.engine.output_processor import RequestState
from services.engine.request import ImageSpan, Request
from services.outputs import TokenLogprobs
from services.sampling_params import SamplingParams

if TYPE_CHECKING:
    from services.engine.llm_engine import LLMEngine


class KVImports:
    """Reservations and adoptions of imported requests; engine thread only."""

    def __init__(self, engine: LLMEngine):
        self.engine = engine
        # request id -> a placeholder Request holding the reserved blocks
        self.reserved: dict[str, Request] = {}

    def reserve(self, request_id: str, num_tokens: int) -> bool:
        """Take blocks for ``num_tokens`` tokens of incoming KV; False when there is no room."""
        eng = self.engine
        if request_id in eng.states or request_id in self.reserved:
            raise ValueError(f"duplicate request id {request_id!r}")
        if not 0 < num_tokens < eng.max_model_len:
            raise ValueError(f"{num_tokens} tokens of KV; the context holds {eng.max_model_len}")
        holder = Request(request_id, [], SamplingParams())
        if eng.block_manager.allocate_for_import(holder, num_tokens) is None:
            return False
        self.reserved[request_id] = holder
        return True

    def release(self, request_id: str) -> None:
        """Give back a reservation that will not be adopted (no-op when there is none)."""
        holder = self.reserved.pop(request_id, None)
        if holder is not None:
            self.engine.block_manager.free(holder)

    def adopt(
        self,
        request_id: str,
        token_ids: list[int],
        num_prompt_tokens: int,
        first_token: int,
        params: SamplingParams,
        kv_blocks: torch.Tensor,
        first_logprobs: TokenLogprobs | None = None,
        aux_hidden: torch.Tensor | None = None,
        images: list[ImageSpan] = (),
    ) -> Request:
        """Continue a request: ``token_ids`` (prompt, then tokens generated before a
        migration) have their KV in ``kv_blocks`` [2, layers, n, block_size, kv_heads,
        head_dim]; ``first_token`` was sampled after them. Reserves first when
        ``reserve`` was not called (MemoryError without room). ``aux_hidden`` [m, A]:
        a draft head's rows of the last m of ``token_ids`` (ignored without one).
        ``images``: the prompt's image spans (M-RoPE positions follow them)."""
        aux_hidden = self._check_aux(aux_hidden, len(token_ids))
        eng = self.engine
        if params.n > 1:
            raise ValueError("n > 1 is not served in the decode role (one request per choice)")
        if not 0 < num_prompt_tokens <= len(token_ids):
            raise ValueError(f"num_prompt_tokens {num_prompt_tokens} of {len(token_ids)} tokens")
        eng.inputs.check_ids([*token_ids, first_token], "imported")
        images = eng.inputs.check_spans(token_ids[:num_prompt_tokens], list(images))
        if request_id not in self.reserved and not self.reserve(request_id, len(token_ids)):
            raise MemoryError("no free KV blocks for the imported request")
        holder = self.reserved.pop(request_id)
        try:
            req = self._adopt(
                holder, token_ids, num_prompt_tokens, first_token, params, kv_blocks, images
            )
        except BaseException:
            eng.block_manager.free(holder)
            raise
        if aux_hidden is not None:
            eng.runner.aux_rows[request_id] = [aux_hidden]
        eng.states[request_id].append(int(first_token), first_logprobs)
        eng.states[request_id].sent_tokens = len(eng.states[request_id].token_ids)
        return req

    def _check_aux(self, rows: torch.Tensor | None, num_tokens: int) -> torch.Tensor | None:
        """The rows in the target's dtype and device, or None when no head wants them."""
        runner = self.engine.runner
        if rows is None or not runner.aux_layers:
            return None
        width = len(runner.aux_layers) * self.engine.loaded.text_config.hidden_size
        if rows.dim() != 2 or rows.shape[1] != width or not 0 < rows.shape[0] <= num_tokens:
            raise ValueError(f"aux hidden rows of shape {list(rows.shape)}, expected [m, {width}]")
        if not rows.is_floating_point():
            raise ValueError(f"aux hidden rows of dtype {rows.dtype}")
        return rows.to(device=self.engine.loaded.device, dtype=self.engine.loaded.dtype)

    def _adopt(
        self, holder: Request, token_ids, num_prompt, first_token, params, kv_blocks, images
    ) -> Request:
        eng, bs = self.engine, self.engine.config.block_size
        state = None
        if eng.hybrid is not None:  # the recurrent state follows the KV blocks
            if kv_blocks.dim() != 6 or kv_blocks.shape[2] <= eng.hybrid.state_blocks:
                raise ValueError(f"KV blocks of shape {tuple(kv_blocks.shape)} lack the state")
            kv_blocks, state = eng.hybrid.split(kv_blocks)
        expected = (
            2,
            eng.loaded.num_kv_layers,
            len(holder.block_ids),
            bs,
            eng.model.num_kv_heads,
            eng.kv.data.shape[-1],  # a quantized cache's rows carry their scales
        )
        if -(-len(token_ids) // bs) != len(holder.block_ids):
            raise ValueError(f"{len(token_ids)} tokens do not fit the reserved blocks")
        if tuple(kv_blocks.shape) != expected:
            raise ValueError(f"KV blocks of shape {tuple(kv_blocks.shape)}, expected {expected}")
        rid = holder.request_id
        req = Request(
            rid,
            list(token_ids[:num_prompt]),
            params,
            eng.eos_token_ids,
            images,
            time.monotonic(),
            eng.max_model_len,
        )
        req.output_token_ids = [*token_ids[num_prompt:], int(first_token)]
        if params.structured_outputs is not None:  # its matcher, past the tokens so far
            req.grammar = eng.grammars.matcher(params.structured_outputs, req.output_token_ids)
        eng.kv.write_blocks(holder.block_ids, kv_blocks)
        if state is not None:
            eng.hybrid.state.write(holder.state_slot, state)
        req.block_ids, holder.block_ids = holder.block_ids, []
        req.state_slot, holder.state_slot = holder.state_slot, None
        req.num_computed_tokens = len(token_ids)
        try:
            eng.scheduler.add_request(req)
        except ValueError:
            eng.block_manager.free(req)
            raise
        state = RequestState(rid, None, list(token_ids[:num_prompt]), params, eng.tokenizer)
        state.resume(token_ids[num_prompt:])
        eng.states[rid] = state
        eng.runner.add_request(req, params.seed if params.seed is not None else 0, [])
        return req
