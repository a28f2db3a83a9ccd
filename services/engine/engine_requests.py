"""The request side of the engine: admit (validate, queue, fan out n > 1), adopt
imported KV (decode role), abort and list requests.

``EngineRequests`` is a base of ``LLMEngine`` (llm_engine.py), which builds the parts
named below; the step loop that serves these requests lives there.
"""

from __future__ import annotations

import random
import time
from typing import TYPE_CHECKING, Any

import torch

from services.engine.output_processor import RequestState
from services.engine.parallel_sampling import ParallelSampling, child_request_id
from services.engine.request import ImageSpan, Request
from services.images import encode_batch
from services.outputs import RequestOutput, TokenLogprobs
from services.sampling_params import SamplingParams
from services.structured.matcher import GrammarSet

if TYPE_CHECKING:
    from services.config import EngineConfig
    from services.engine.input_processor import InputProcessor
    from services.engine.kv_cache import KVCachePool
    from services.engine.kv_export import KVExports
    from services.engine.kv_import import KVImports
    from services.engine.model_runner import ModelRunner
    from services.engine.scheduler import Scheduler
    from services.engine.spec.decoding import SpecDecoding
    from services.images import ImagePreprocessor
    from services.models.factory import LoadedModel


class EngineRequests:
    """Requests in and out of the engine's scheduler, runner and output state."""

    # Built by LLMEngine.__init__.
    config: EngineConfig
    loaded: LoadedModel
    model: torch.nn.Module
    tokenizer: Any  # transformers' AutoTokenizer
    grammars: GrammarSet
    image_preprocessor: ImagePreprocessor | None
    eos_token_ids: tuple[int, ...]
    max_model_len: int
    step_tokens: int
    kv: KVCachePool
    scheduler: Scheduler
    runner: ModelRunner
    spec: SpecDecoding | None
    inputs: InputProcessor
    states: dict[str, RequestState]
    parallel: ParallelSampling
    exports: KVExports
    imports: KVImports
    _rng: random.Random

    def add_request(
        self,
        request_id: str,
        prompt,
        params: SamplingParams | None = None,
        *,
        image_embeds: list[torch.Tensor] | None = None,
        add_special_tokens: bool = True,
        export_kv: bool = False,
        final_only: bool = False,
        resume: list[int] | None = None,
    ) -> Request:
        """Validate and queue a request; raises ValueError naming the problem.

        ``final_only``: ``step`` returns this request's output once, when it finishes.

        ``export_kv`` is the prefill role: the request stops after its first token and
        its output carries the prompt's KV blocks for a decode instance.

        ``resume``: a migrated request's tokens generated so far (elsewhere): they count as
        output (max_tokens, penalties, the (seed, position) of the next draw) and are not
        sent again.

        ``params.n`` > 1 queues choice 0 now and its siblings once its prompt is computed
        (parallel_sampling.py); the returned Request is choice 0's.
        """
        params = params or SamplingParams()
        if request_id in self.states or request_id in self.parallel.parents:
            raise ValueError(f"duplicate request id {request_id!r}")
        if params.n > 1 and (export_kv or resume):
            raise ValueError("n > 1 is not served in the prefill role (one request per choice)")
        p = self.inputs.process(prompt, add_special_tokens)
        resume = self.inputs.check_ids(resume or [], "resumed output")
        if params.structured_outputs is not None:
            self.grammars.check(params.structured_outputs)
        self._check_budget(len(p.token_ids) + len(resume))
        if image_embeds is None:
            image_embeds = self.encode_images([(im, p.options) for im in p.images])
        embeds = self._check_embeds(p.spans, image_embeds)
        if params.n == 1:
            return self._add(request_id, p, params, embeds, final_only, export_kv, resume=resume)
        base_seed = params.seed if params.seed is not None else self._rng.getrandbits(63)
        self.parallel.add(
            request_id,
            params,
            base_seed,
            p.prompt,
            p.token_ids,
            final_only,
            lambda cid, sp, i, front: self._add(
                cid, p, sp, embeds, final_only, index=i, front=front
            ),
        )
        return self.scheduler.get_request(child_request_id(request_id, 0))

    def _add(
        self,
        request_id: str,
        p,
        params: SamplingParams,
        embeds,
        final_only: bool,
        export_kv: bool = False,
        index: int = 0,
        front: bool = False,
        resume: list[int] = (),
    ) -> Request:
        req = Request(
            request_id,
            p.token_ids,
            params,
            self.eos_token_ids,
            p.spans,
            time.monotonic(),
            self.max_model_len,
        )
        req.output_token_ids = list(resume)
        if params.structured_outputs is not None:
            req.grammar = self.grammars.matcher(params.structured_outputs, list(resume))
        # The scheduler's checks may still reject it: nothing else may be touched before
        # (no state left behind, no draw from the shared seed stream).
        self.scheduler.add_request(req, front=front)
        seed = params.seed if params.seed is not None else self._rng.getrandbits(63)
        self.runner.add_request(req, seed, embeds)
        state = RequestState(
            request_id, p.prompt, p.token_ids, params, self.tokenizer, final_only, index
        )
        state.resume(list(resume))
        self.states[request_id] = state
        if export_kv:
            self.exports.pending.add(request_id)
        return req

    def import_request(
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
        """Decode role: continue a request whose KV was computed elsewhere (kv_import.py);
        ``aux_hidden``: the draft head's rows of the last prompt position(s); ``images``:
        the prompt's image spans."""
        return self.imports.adopt(
            request_id,
            token_ids,
            num_prompt_tokens,
            first_token,
            params,
            kv_blocks,
            first_logprobs,
            aux_hidden,
            images,
        )

    def reserve_import(self, request_id: str, num_tokens: int) -> bool:
        """Decode role: blocks for incoming KV, before the transfer is accepted."""
        return self.imports.reserve(request_id, num_tokens)

    def release_import(self, request_id: str) -> None:
        """Decode role: give back a reservation whose KV will not come."""
        self.imports.release(request_id)

    def _check_embeds(self, spans, embeds: list) -> list[torch.Tensor]:
        """One embedding per image span, [span length, the model's embedding width], on
        the model's device and in its dtype (a cached one comes back on the CPU)."""
        lm = self.loaded
        if len(embeds) != len(spans):
            raise ValueError(f"{len(embeds)} image embeddings for {len(spans)} images")
        out = []
        for span, emb in zip(spans, embeds, strict=True):
            if list(emb.shape) != [span.length, lm.image_embedding_width]:
                raise ValueError(
                    f"an image embedding of shape {list(emb.shape)} for an image of "
                    f"{span.length} tokens; expected [{span.length}, {lm.image_embedding_width}]"
                )
            out.append(emb.to(device=lm.device, dtype=lm.dtype))
        return out

    def _check_budget(self, n: int) -> None:
        c = self.config
        if not c.enable_chunked_prefill and n > self.step_tokens:
            raise ValueError(
                f"prompt of {n} tokens exceeds max_num_batched_tokens without chunked prefill"
            )
        blocks = (n + c.block_size) // c.block_size
        if blocks > self.kv.num_blocks:
            raise ValueError(f"prompt needs {blocks} KV blocks; the pool has {self.kv.num_blocks}")

    @torch.inference_mode()
    def encode_images(self, items: list) -> list[torch.Tensor]:
        """[(PIL image, ImageOptions)] -> one embedding [image tokens, hidden] per image."""
        if not items:
            return []
        return encode_batch(self.model, self.image_preprocessor, items, self.loaded.device)

    def abort_request(self, request_id: str) -> RequestOutput | None:
        """Abort a request (every choice of an n > 1 one) or one choice (its child id)."""
        out = self.parallel.abort(request_id, self._abort_one)
        return out if out is not None else self._abort_one(request_id)

    def _abort_one(self, request_id: str) -> RequestOutput | None:
        self.imports.release(request_id)
        req = self.scheduler.abort_request(request_id)
        state = self.states.pop(request_id, None)
        self._drop_request(request_id)
        if req is None or state is None:
            return None
        self.exports.pending.discard(request_id)
        state.finish("abort")
        return state.make_output()

    def request_ids(self) -> list[str]:
        """Ids of the unfinished requests as their callers know them (parents, not choices)."""
        return list(self.parallel.parents) + [
            r for r in self.states if not self.parallel.is_choice(r)
        ]

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished() or bool(self.parallel.pending)

    def _drop_request(self, request_id: str) -> None:
        """Forget a finished or aborted request's runner (and proposer) state."""
        self.runner.drop_request(request_id)
        if self.spec is not None:
            self.spec.free(request_id)
