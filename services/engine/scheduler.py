"""Continuous-batching scheduler: one token budget per step (STYLE.md 3), torch-free.

A request needs ``num_tokens - num_computed_tokens`` tokens computed; prefill, chunked
prefill and decode are the same loop. Running requests are served first, then waiting
ones are admitted FIFO. When the KV pool runs out, the most recently admitted running
request is preempted by recompute: its blocks are freed and it goes back to the front
of the waiting queue (its cached prefix blocks usually make the recompute cheap).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping

from services.engine.block_manager import BlockManager
from services.engine.request import Request, RequestStatus
from services.engine.scheduler_config import SchedulerConfig
from services.engine.scheduler_output import ScheduledRequest, SchedulerOutput
from services.engine.spec.rollback import settle_step
from services.engine.stopping import stop_status


class Scheduler:
    """Decides, each step, which requests compute how many tokens."""

    def __init__(self, config: SchedulerConfig, block_manager: BlockManager):
        self.config = config
        self.block_manager = block_manager
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self._requests: dict[str, Request] = {}
        self._finished_ids: list[str] = []
        # Total preemptions so far (a metric, and tests force them).
        self.num_preemptions = 0

    # ----------------------------------------------------------------- queue

    @property
    def num_running(self) -> int:
        """Requests holding KV blocks and scheduled each step."""
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        """Requests queued for admission (new or preempted)."""
        return len(self.waiting)

    def has_unfinished(self) -> bool:
        """True while any request is waiting or running."""
        return bool(self._requests)

    def get_request(self, request_id: str) -> Request | None:
        """The unfinished request with this id, if any."""
        return self._requests.get(request_id)

    def add_request(self, request: Request, front: bool = False) -> None:
        """Queue a request (FIFO; ``front``: ahead of the queue). A request may arrive
        holding imported KV blocks (``block_ids`` and ``num_computed_tokens`` set); it
        then skips the prefix cache.
        """
        if request.request_id in self._requests:
            raise ValueError(f"duplicate request id {request.request_id!r}")
        request.max_model_len = min(request.max_model_len, self.config.max_model_len)
        self._check_fits(request)
        request.status = RequestStatus.WAITING
        self._requests[request.request_id] = request
        if front:
            self.waiting.appendleft(request)
        else:
            self.waiting.append(request)

    def _check_fits(self, request: Request) -> None:
        rid = request.request_id
        if not request.prompt_token_ids:
            raise ValueError(f"request {rid!r} has an empty prompt")
        if request.num_prompt_tokens > request.max_model_len:
            raise ValueError(
                f"request {rid!r}: prompt of {request.num_prompt_tokens} tokens exceeds "
                f"max_model_len={request.max_model_len}"
            )
        if request.num_computed_tokens >= request.num_tokens:
            raise ValueError(f"request {rid!r} has no token left to compute")
        # Alone in the engine a request must be able to reach its last token; otherwise
        # it would preempt itself and be readmitted forever.
        bm = self.block_manager
        need = -(-request.max_total_tokens // bm.block_size)
        if need > bm.num_blocks:
            raise ValueError(
                f"request {rid!r} may need {need} KV blocks ({request.max_total_tokens} "
                f"tokens), the pool has {bm.num_blocks}; lower max_tokens"
            )

    def abort_request(self, request_id: str) -> Request | None:
        """Abort a waiting or running request; None if unknown or already finished."""
        return self.finish_request(request_id, RequestStatus.FINISHED_ABORTED)

    def finish_request(
        self, request_id: str, status: RequestStatus, stop_reason: int | str | None = None
    ) -> Request | None:
        """Finish a request from outside the step loop (stop strings, aborts)."""
        if not status.finished:
            raise ValueError(f"{status} is not a finished status")
        request = self._requests.get(request_id)
        if request is None:
            return None
        request.stop_reason = stop_reason
        self._finish(request, status)
        return request

    def _finish(self, request: Request, status: RequestStatus) -> None:
        if request.status is RequestStatus.RUNNING:
            self.running.remove(request)
        else:
            self.waiting.remove(request)
        self.block_manager.free(request)
        request.status = status
        del self._requests[request.request_id]
        self._finished_ids.append(request.request_id)

    # ----------------------------------------------------------------- step

    def schedule(self, num_steps: int = 1) -> SchedulerOutput:
        """Pick this step's requests and grow their block tables to cover them.

        ``num_steps`` > 1 asks for a burst: when nothing waits and every running request
        is a pure decode, they all run that many decode steps at once (fewer when one of
        them would pass its last token or the pool lacks the blocks; at 1, a normal step).
        The caller decides which requests may burst (e.g. greedy ones only).
        """
        output = SchedulerOutput(finished_ids=self._finished_ids)
        self._finished_ids = []
        if num_steps > 1 and self._schedule_burst(output, num_steps):
            return output
        budget = self._schedule_running(output, self.config.max_num_batched_tokens)
        # Admitting after a preemption would only take the blocks just freed for the
        # preempted request, which is first in line.
        if not output.preempted_ids:
            self._schedule_waiting(output, budget)
        return output

    def _schedule_running(self, output: SchedulerOutput, budget: int) -> int:
        index = 0
        while index < len(self.running) and budget > 0:
            request = self.running[index]
            pending = request.num_tokens - request.num_computed_tokens
            if pending != 1:  # drafts extend the last known token only
                request.spec_token_ids = []
            num_new = self._chunk(request, min(pending + len(request.spec_token_ids), budget))
            if num_new <= 0:  # nothing known to compute, or an image waiting for room
                index += 1
                continue
            if num_new > pending and not self.block_manager.allocate_slots(request, num_new):
                num_new = pending  # drafts are not worth preempting anyone for
            while not self.block_manager.allocate_slots(request, num_new):
                victim = self.running.pop()
                self._preempt(victim)
                output.preempted_ids.append(victim.request_id)
                if victim is request:
                    return budget  # it was the last one running
            output.scheduled.append(self._scheduled(request, num_new))
            budget -= num_new
            index += 1
        return budget

    def _schedule_burst(self, output: SchedulerOutput, num_steps: int) -> bool:
        running = self.running
        if (
            self.waiting
            or not running
            or len(running) > self.config.max_num_batched_tokens
            or any(r.num_tokens - r.num_computed_tokens != 1 for r in running)
        ):
            return False
        # Every step of the burst samples a token, so none may go past its last one.
        steps = min(num_steps, *(r.max_total_tokens - r.num_tokens for r in running))
        bm = self.block_manager
        need = sum(
            max(0, -(-(r.num_computed_tokens + steps) // bm.block_size) - len(r.block_ids))
            for r in running
        )
        if steps < 2 or need > bm.num_free_blocks:
            return False
        for request in running:
            bm.allocate_slots(request, steps)
            output.scheduled.append(self._scheduled(request, 1))
        output.num_steps = steps
        return True

    def _schedule_waiting(self, output: SchedulerOutput, budget: int) -> None:
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            request = self.waiting[0]
            if request.block_ids:  # KV imported from a prefill instance
                computed, num_cached = None, request.num_computed_tokens
            else:
                computed, num_cached = self.block_manager.get_computed_blocks(request)
            remaining = request.num_tokens - num_cached
            num_new = self._chunk(request, min(remaining, budget), num_cached)
            if num_new <= 0 or (not self.config.enable_chunked_prefill and num_new < remaining):
                break
            if not self.block_manager.allocate_slots(request, num_new, computed):
                break  # FIFO: later requests do not overtake the head
            self.waiting.popleft()
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            output.scheduled.append(self._scheduled(request, num_new))
            budget -= num_new

    def _chunk(self, request: Request, num_new: int, start: int | None = None) -> int:
        """``num_new`` tokens from ``start`` (default: the computed ones), cut back to
        the start of an image the chunk would end inside, under ``whole_images``."""
        if not self.config.whole_images:
            return num_new
        start = request.num_computed_tokens if start is None else start
        end = start + num_new
        for span in request.images:
            if span.offset < end < span.offset + span.length:
                return span.offset - start  # <= 0: the image waits for a roomier step
        return num_new

    @staticmethod
    def _scheduled(request: Request, num_new: int) -> ScheduledRequest:
        start = request.num_computed_tokens
        # Drafts ride along only with the request's last known token (engine's rule);
        # a step budget too small for all of them keeps the first ones.
        drafts = request.spec_token_ids[: max(0, start + num_new - request.num_tokens)]
        request.spec_token_ids = []
        return ScheduledRequest(
            request=request,
            num_new_tokens=num_new,
            start=start,
            sample=start + num_new >= request.num_tokens,
            draft_token_ids=drafts,
        )

    def _preempt(self, request: Request) -> None:
        self.block_manager.free(request)
        request.spec_token_ids = []
        request.num_computed_tokens = 0
        request.num_cached_tokens = 0
        request.status = RequestStatus.PREEMPTED
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(request)

    def update_from_tokens(
        self, output: SchedulerOutput, sampled: Mapping[str, list[int]]
    ) -> tuple[list[Request], dict[str, list[int]]]:
        """Apply a step that emits several tokens per request: a burst (``num_steps``
        tokens each) or a verification of drafts (spec/rollback.py).

        ``sampled`` maps each sampling request to the tokens it emits: a burst's tokens,
        or its accepted drafts then the target's own token. Tokens count one by one (a
        stop or the length limit inside them truncates there, as that many steps would);
        rejected drafts' slots are rolled back. Returns the finished requests and the
        tokens each request kept.
        """
        finished: list[Request] = []
        kept: dict[str, list[int]] = {}
        for item in output.scheduled:
            request = item.request
            if request.status is not RequestStatus.RUNNING:
                continue
            tokens = sampled.get(request.request_id)
            if tokens and len(tokens) > len(item.draft_token_ids) + output.num_steps:
                raise ValueError(f"{len(tokens)} tokens for {request.request_id!r}: too many")
            tokens, stop = settle_step(self.block_manager, item, tokens)
            if tokens:
                kept[request.request_id] = tokens
            if stop is not None:
                request.stop_reason = stop[1]
                self._finish(request, stop[0])
                finished.append(request)
        return finished, kept

    def update_from_output(
        self, output: SchedulerOutput, sampled: Mapping[str, int]
    ) -> list[Request]:
        """Apply a step's results; return the requests that finished with it.

        ``sampled`` maps request id to the token sampled for it; only requests whose
        step reached their last known token have one.
        """
        finished: list[Request] = []
        for item in output.scheduled:
            request = item.request
            if request.status is not RequestStatus.RUNNING:
                continue  # aborted or finished while the step ran
            request.num_computed_tokens += item.num_new_tokens
            self.block_manager.cache_full_blocks(request, request.num_computed_tokens)
            token = sampled.get(request.request_id)
            if token is None or not item.sample:
                continue
            request.append_output_token(token)
            stop = stop_status(request)
            if stop is not None:
                request.stop_reason = stop[1]
                self._finish(request, stop[0])
                finished.append(request)
        return finished
