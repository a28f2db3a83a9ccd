"""The synchronous engine: requests in, one step at a time, RequestOutputs out."""

from __future__ import annotations

import logging
import random
import time

import torch

from services.config import EngineConfig
from services.engine.block_manager import BlockManager
from services.engine.input_processor import InputProcessor
from services.engine.kv_cache import KVCachePool
from services.engine.kv_export import KVExports
from services.engine.kv_import import KVImports
from services.engine.model_runner import ModelRunner, plain_greedy
from services.engine.output_processor import RequestState
from services.engine.parallel_sampling import ParallelSampling, child_request_id
from services.engine.request import Request, RequestStatus
from services.engine.scheduler import Scheduler
from services.engine.scheduler_config import SchedulerConfig
from services.engine.spec.decoding import SpecDecoding
from services.engine.step_metrics import observe_scheduled, observe_step
from services.images import ImagePreprocessor
from services.kernels.backend import get_backend
from services.models.factory import LoadedModel, load_model, resolve_device
from services.models.registry import is_multimodal
from services.outputs import RequestOutput, TokenLogprobs
from services.sampling_params import SamplingParams
from services.tokenization import load_tokenizer

log = logging.getLogger(__name__)


class LLMEngine:
    """Owns model, KV pool, scheduler and per-request output state (one thread)."""

    def __init__(self, config: EngineConfig):
        self.config = config
        device = resolve_device(config.device)
        self.backend = get_backend(
            config.attention_backend,
            device,
            config.kernel_cache_dir,
            config.kernel_cc,
            greedy_head_screen=config.greedy_head_screen,
            packed_weights_mb=config.packed_weights_mb,
        )
        self.step_tokens = config.step_token_budget(device.type)
        self.loaded = lm = load_model(config, self.backend)
        self.model = lm.model
        self.tokenizer = load_tokenizer(lm.model_dir)
        self.multimodal = is_multimodal(lm.model)
        self.image_preprocessor = ImagePreprocessor(lm.model_dir) if self.multimodal else None
        self.eos_token_ids = lm.info.eos_token_ids(self.tokenizer.eos_token_id)
        self.max_model_len = lm.max_model_len
        self.kv = self._make_kv_pool(lm)
        self.block_manager = BlockManager(
            self.kv.num_blocks, config.block_size, config.enable_prefix_caching
        )
        self.scheduler = Scheduler(
            SchedulerConfig(
                max_num_batched_tokens=self.step_tokens,
                max_num_seqs=config.max_num_seqs,
                max_model_len=lm.max_model_len,
                enable_chunked_prefill=config.enable_chunked_prefill,
            ),
            self.block_manager,
        )
        self.runner = ModelRunner(lm.model, self.kv, self.backend, lm.device)
        spec = config.speculative_config
        self.spec = SpecDecoding.build(spec, lm, self.runner) if spec is not None else None
        self.inputs = InputProcessor(
            self.tokenizer,
            lm.max_model_len,
            lm.text_config.vocab_size,
            getattr(lm.model, "image_token_id", None),
            getattr(lm.model, "tokens_per_image", 0),
            lm.fingerprint,
        )
        self.states: dict[str, RequestState] = {}
        self.parallel = ParallelSampling()  # n > 1 requests and their choices
        self.exports = KVExports(self.scheduler, self.kv, self.runner, config.block_size)
        self._rng = random.Random(config.seed)
        self.imports = KVImports(self)

    def _make_kv_pool(self, lm: LoadedModel) -> KVCachePool:
        c, m = self.config, lm.model
        args = (lm.num_layers, c.block_size, m.num_kv_heads, m.head_dim, lm.dtype, lm.device)
        if c.num_kv_blocks is not None:
            return KVCachePool(lm.num_layers, c.num_kv_blocks, *args[1:])
        return KVCachePool.from_budget(c.kv_cache_memory_mb, *args)

    # -- requests ---------------------------------------------------------------------
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
        self._check_budget(len(p.token_ids) + len(resume))
        embeds = image_embeds if image_embeds is not None else self.encode_images(p.images)
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
    ) -> Request:
        """Decode role: continue a request whose KV was computed elsewhere (kv_import.py);
        ``aux_hidden``: the draft head's rows of the last prompt position(s)."""
        return self.imports.adopt(
            request_id,
            token_ids,
            num_prompt_tokens,
            first_token,
            params,
            kv_blocks,
            first_logprobs,
            aux_hidden,
        )

    def reserve_import(self, request_id: str, num_tokens: int) -> bool:
        """Decode role: blocks for incoming KV, before the transfer is accepted."""
        return self.imports.reserve(request_id, num_tokens)

    def release_import(self, request_id: str) -> None:
        """Decode role: give back a reservation whose KV will not come."""
        self.imports.release(request_id)

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
    def encode_images(self, images: list) -> list[torch.Tensor]:
        """PIL images -> one embedding tensor [tokens_per_image, hidden] per image."""
        if not images:
            return []
        pixels = self.image_preprocessor(images).to(self.loaded.device)
        return list(self.model.encode_images(pixels))

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

    # -- stepping ---------------------------------------------------------------------
    def _burst_steps(self) -> int:
        """Steps to ask the scheduler for: num_scheduler_steps when every running request
        may take its tokens in a burst (plain greedy, not a prefill-role export) and no
        speculative decoding."""
        n = self.config.num_scheduler_steps
        if n <= 1 or self.spec is not None or self.exports.pending:  # spec: steps verify drafts
            return 1
        return n if all(plain_greedy(r) for r in self.scheduler.running) else 1

    def _drop_request(self, request_id: str) -> None:
        """Forget a finished or aborted request's runner (and proposer) state."""
        self.runner.drop_request(request_id)
        if self.spec is not None:
            self.spec.free(request_id)

    def _run_step(self, so) -> tuple[list[Request], dict, dict, dict]:
        """Run the scheduled step: (finished, tokens per request, their logprobs per
        request, exported KV)."""
        if so.num_steps > 1:
            burst = self.runner.execute_burst(so.scheduled, so.num_steps)
            return (*self.scheduler.update_from_tokens(so, burst), {}, {})
        if self.spec is not None:
            result = self.runner.execute_verify(so.scheduled)
            exported = self.exports.take({rid: t[0] for rid, t in result.tokens.items()})
            self.spec.observe(so, result.tokens)
            finished, new_tokens = self.scheduler.update_from_tokens(so, result.tokens)
            return finished, new_tokens, result.logprobs, exported
        result = self.runner.execute(so.scheduled)
        exported = self.exports.take(result.sampled)
        finished = self.scheduler.update_from_output(so, result.sampled)
        new_tokens = {rid: [token] for rid, token in result.sampled.items()}
        return finished, new_tokens, {r: [lp] for r, lp in result.logprobs.items()}, exported

    def step(self) -> list[RequestOutput]:
        if self.spec is not None:
            self.spec.propose(self.scheduler.running, self.exports.pending, self.runner)
        so = self.scheduler.schedule(self._burst_steps())
        observe_scheduled(so)
        for rid in so.finished_ids:
            self._drop_request(rid)
        for rid in so.preempted_ids:  # recomputed later: hidden rows come again
            self.runner.aux_rows.pop(rid, None)
            if self.spec is not None:
                self.spec.free(rid)
        finished, new_tokens, logprobs, exported = self._run_step(so)
        observe_step(so, new_tokens)
        touched = self._append(new_tokens, logprobs)
        for req in finished:
            if req.request_id in self.states:
                self.states[req.request_id].finish(req.status.value, req.stop_reason)
                touched[req.request_id] = self.states[req.request_id]
        for item in so.scheduled:
            if item.request.request_id in touched:
                touched[item.request.request_id].num_cached_tokens = item.request.num_cached_tokens
        for rid in exported:
            req = self.scheduler.get_request(rid)
            if req is not None:  # handed off to a decode instance: done here
                self.scheduler.finish_request(rid, RequestStatus.FINISHED_STOPPED)
                touched[rid].handed_off = True
        return self._outputs(touched, exported)

    def _append(self, new_tokens: dict[str, list[int]], logprobs: dict) -> dict[str, RequestState]:
        """Append this step's tokens to their requests' output state, up to a stop string
        (which finishes the request here); returns the states touched."""
        touched: dict[str, RequestState] = {}
        for rid, tokens in new_tokens.items():
            state = self.states.get(rid)
            if state is None:
                continue
            touched[rid] = state
            stop, lps = None, logprobs.get(rid, [])
            for i, token in enumerate(tokens):
                lp = lps[i] if i < len(lps) else None
                if (stop := state.append(token, lp)) is not None:
                    break
            if stop is not None:
                state.finish("stop", stop)
                req = self.scheduler.get_request(rid)
                if req is not None and not req.is_finished:
                    self.scheduler.finish_request(rid, RequestStatus.FINISHED_STOPPED, stop)
                    self._drop_request(rid)
        return touched

    def _outputs(self, touched: dict[str, RequestState], exported: dict) -> list[RequestOutput]:
        """This step's outputs; choices of an n > 1 request merge into their parent's."""
        produced = []
        for rid, state in touched.items():
            out = state.make_output() if state.wants_output() else None
            if out is not None:
                out.kv_blocks = exported.get(rid)
                out.aux_hidden = self.exports.pop_aux(rid)
                if out.finished:
                    self.states.pop(rid, None)
                    self._drop_request(rid)
            produced.append((rid, bool(state.token_ids), out))
        return self.parallel.gather(produced)
