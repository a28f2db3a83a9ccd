"""The synchronous engine: its parts built from an EngineConfig, and the step loop
(schedule, run, append tokens, RequestOutputs out).

How requests get in and out (add, import, abort) is ``EngineRequests``
(engine_requests.py), a base of ``LLMEngine``.
"""

from __future__ import annotations

import logging
import random

import torch

from services.config import EngineConfig
from services.engine.block_manager import BlockManager
from services.engine.engine_requests import EngineRequests
from services.engine.input_processor import InputProcessor
from services.engine.kv_cache import KVCachePool
from services.engine.kv_export import KVExports
from services.engine.kv_import import KVImports
from services.engine.mamba_state import HybridCache
from services.engine.model_runner import ModelRunner, plain_greedy
from services.engine.output_processor import RequestState
from services.engine.parallel_sampling import ParallelSampling
from services.engine.request import Request, RequestStatus
from services.engine.scheduler import Scheduler
from services.engine.scheduler_config import SchedulerConfig
from services.engine.spec.decoding import SpecDecoding
from services.engine.step_metrics import observe_scheduled, observe_step
from services.engine.thinking import thinking_pending
from services.images import ImagePreprocessor
from services.kernels import kv_quant
from services.kernels.backend import get_backend
from services.models.factory import LoadedModel, load_model, resolve_device
from services.models.registry import is_multimodal
from services.outputs import RequestOutput
from services.structured.matcher import GrammarSet
from services.tokenization import load_tokenizer

log = logging.getLogger(__name__)


# A decode instance holds an imported request's KV, not its images' embeddings: preempted,
# it cannot recompute the prompt.
_NO_EMBEDDINGS = "preempted on a decode instance, which cannot recompute a prompt with images"


class LLMEngine(EngineRequests):
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
        self.grammars = GrammarSet(
            self.tokenizer,
            list(self.eos_token_ids),
            lm.text_config.vocab_size,
            config.structured_outputs_backend,
        )
        self.max_model_len = lm.max_model_len
        self.hybrid = self._hybrid_cache(lm)
        self.kv = self.hybrid.kv if self.hybrid is not None else self._make_kv_pool(lm)
        self.block_manager = self._make_block_manager()
        self.scheduler = Scheduler(
            SchedulerConfig(
                max_num_batched_tokens=self.step_tokens,
                max_num_seqs=config.max_num_seqs,
                max_model_len=lm.max_model_len,
                enable_chunked_prefill=config.enable_chunked_prefill,
                whole_images=self._whole_images(lm),
            ),
            self.block_manager,
        )
        self.runner = ModelRunner(lm.model, self.kv, self.backend, lm.device, self.hybrid)
        spec = config.speculative_config
        self.spec = SpecDecoding.build(spec, lm, self.runner) if spec is not None else None
        self.inputs = InputProcessor(
            self.tokenizer,
            lm.max_model_len,
            lm.text_config.vocab_size,
            lm.info.image_token_id if self.multimodal else None,
            lm.info.image_grid,
            lm.fingerprint,
            image_boundary=lm.info.image_boundary,
        )
        self.states: dict[str, RequestState] = {}
        self.parallel = ParallelSampling()  # n > 1 requests and their choices
        self.exports = KVExports(
            self.scheduler, self.kv, self.runner, config.block_size, self.hybrid
        )
        self._rng = random.Random(config.seed)
        self.imports = KVImports(self)

    def _whole_images(self, lm: LoadedModel) -> bool:
        """Whether each image must be prefilled in one chunk (Gemma 3), and then that a
        step holds one beside a decode token of every other request (running requests
        take the budget first: with less, an image could wait as long as decodes run)."""
        if not getattr(lm.model, "bidirectional_images", False):
            return False
        need = lm.info.tokens_per_image + self.config.max_num_seqs - 1
        if self.step_tokens < need:
            raise ValueError(
                f"max_num_batched_tokens {self.step_tokens} is under {need}: an image's "
                f"{lm.info.tokens_per_image} tokens, which this model prefills in one chunk, "
                f"beside a decode token of each of max_num_seqs - 1 other requests"
            )
        return True

    def _make_block_manager(self) -> BlockManager:
        """Over the KV pool; a hybrid model's state slots with it, and no prefix cache."""
        hybrid = self.hybrid
        return BlockManager(
            self.kv.num_blocks,
            self.config.block_size,
            self.config.enable_prefix_caching and hybrid is None,
            num_state_slots=hybrid.state.num_slots if hybrid is not None else 0,
        )

    def _hybrid_cache(self, lm: LoadedModel) -> HybridCache | None:
        """The KV and state pools of a model with recurrent layers; None for the rest."""
        if not getattr(lm.model, "num_state_layers", 0):
            return None
        if self.config.speculative_config is not None:
            raise ValueError(
                "speculative decoding is not supported for hybrid (Mamba) models: rejected "
                "drafts would have to be rolled back in the recurrent state"
            )
        if self.config.enable_prefix_caching:
            log.info(
                "prefix caching is off for %s: a hybrid model's recurrent state is not "
                "kept at block boundaries (services/engine/mamba_state.py)",
                lm.info.model_id,
            )
        return HybridCache.build(lm.model, self.config, self._kv_dtype(lm), lm.device)

    def _kv_dtype(self, lm: LoadedModel) -> torch.dtype:
        if self.config.kv_cache_dtype == "auto":
            return lm.dtype
        if self.backend.name == "triton":
            raise ValueError(
                f"kv_cache_dtype {self.config.kv_cache_dtype} is served by the cpu and torch "
                "backends only"
            )
        return kv_quant.FORMATS[self.config.kv_cache_dtype][0]

    def _make_kv_pool(self, lm: LoadedModel) -> KVCachePool:
        c, m = self.config, lm.model
        dtype = self._kv_dtype(lm)
        args = (lm.num_layers, c.block_size, m.num_kv_heads, m.head_dim, dtype, lm.device)
        if c.num_kv_blocks is not None:
            return KVCachePool(lm.num_layers, c.num_kv_blocks, *args[1:])
        return KVCachePool.from_budget(c.kv_cache_memory_mb, *args)

    # -- stepping ---------------------------------------------------------------------
    def _burst_steps(self) -> int:
        """Steps to ask the scheduler for: num_scheduler_steps when every running request
        may take its tokens in a burst (plain greedy, not a prefill-role export) and no
        speculative decoding."""
        n = self.config.num_scheduler_steps
        if n <= 1 or self.spec is not None or self.exports.pending:  # spec: steps verify drafts
            return 1
        running = self.scheduler.running
        if any(thinking_pending(r) for r in running):  # its end is forced at one position
            return 1
        return n if all(plain_greedy(r) for r in running) else 1

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
        lost = []
        for rid in so.preempted_ids:  # recomputed later: hidden rows come again
            self.runner.aux_rows.pop(rid, None)
            if self.spec is not None:
                self.spec.free(rid)
            if self.runner.images.lacks(self.scheduler.get_request(rid)):
                lost.append(self._fail(rid, _NO_EMBEDDINGS))
        finished, new_tokens, logprobs, exported = self._run_step(so)
        observe_step(so, new_tokens)
        touched = self._append(new_tokens, logprobs, _stopped_by_token(finished))
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
        return self._outputs(touched, exported) + [out for out in lost if out is not None]

    def _fail(self, request_id: str, why: str) -> RequestOutput | None:
        """Abort a request with an error its caller sees (the fleet's gateway retries)."""
        out = self.abort_request(request_id)
        if out is not None:
            out.error = why
        return out

    def _append(
        self, new_tokens: dict[str, list[int]], logprobs: dict, stopped: set[str]
    ) -> dict[str, RequestState]:
        """Append this step's tokens to their requests' output state, up to a stop string
        (which finishes the request here); returns the states touched. ``stopped``: the
        requests whose last token is the stop token (it adds no text)."""
        touched: dict[str, RequestState] = {}
        for rid, tokens in new_tokens.items():
            state = self.states.get(rid)
            if state is None:
                continue
            touched[rid] = state
            stop, lps = None, logprobs.get(rid, [])
            for i, token in enumerate(tokens):
                lp = lps[i] if i < len(lps) else None
                text = rid not in stopped or i < len(tokens) - 1
                if (stop := state.append(token, lp, text)) is not None:
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


def _stopped_by_token(finished: list[Request]) -> set[str]:
    """The requests a token stopped (EOS or a stop token id, not a stop string)."""
    return {
        r.request_id
        for r in finished
        if r.status == RequestStatus.FINISHED_STOPPED and not isinstance(r.stop_reason, str)
    }
