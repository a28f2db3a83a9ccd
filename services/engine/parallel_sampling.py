"""``n`` > 1 (vLLM's ``SamplingParams.n``): one request, n choices over one prompt.

Each choice is a child request of its own (id ``<parent>#<index>``, seed from
``choice_seed``), so the scheduler, the runner and the stop rules need nothing new. The
children share the prompt's KV blocks through the prefix cache: choice 0 is scheduled
first, and its siblings only join once its prompt is computed (its full blocks are
cached then), so each sibling computes only the tail of the prompt that does not fill a
block. Without prefix caching the siblings compute the prompt again (same tokens).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace

from services.outputs import CompletionOutput, RequestOutput
from services.sampling_params import SamplingParams, choice_seed

# (child id, its params, choice index, ahead of the waiting queue?) -> queue that choice
AddChoice = Callable[[str, SamplingParams, int, bool], None]


def child_request_id(parent_id: str, index: int) -> str:
    """The engine's id of choice ``index`` of ``parent_id``."""
    return f"{parent_id}#{index}"


@dataclass
class ParentRequest:
    """The choices of one n > 1 request and what they have produced so far."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    # child id -> choice index
    children: dict[str, int]
    # Adds the siblings to the scheduler; run once choice 0's prompt is computed.
    release_siblings: Callable[[], None] | None
    final_only: bool = False
    # Children that finished (or were aborted).
    done: set[str] = field(default_factory=set)
    # Latest output of each choice (the merged final output takes them all).
    latest: dict[int, CompletionOutput] = field(default_factory=dict)
    num_cached_tokens: int = 0

    @property
    def first_child(self) -> str:
        return child_request_id(self.request_id, 0)

    @property
    def finished(self) -> bool:
        return len(self.done) == len(self.children)

    def release(self) -> None:
        """Let the siblings in (idempotent)."""
        release, self.release_siblings = self.release_siblings, None
        if release is not None:
            release()

    def merge(self, outs: list[RequestOutput]) -> RequestOutput | None:
        """This step's outputs of some children -> the parent's output (None when there
        is nothing to report yet: final-only requests report once, when all are done)."""
        for out in outs:
            comp = out.outputs[0]
            self.latest[comp.index] = comp
            if out.finished:
                self.done.add(out.request_id)
            if comp.index == 0:
                self.num_cached_tokens = out.num_cached_tokens
        if self.final_only and not self.finished:
            return None
        comps = (
            [self.latest[i] for i in sorted(self.latest)]
            if self.finished and self.final_only
            else sorted((o.outputs[0] for o in outs), key=lambda c: c.index)
        )
        return RequestOutput(
            self.request_id,
            self.prompt,
            self.prompt_token_ids,
            comps,
            self.finished,
            self.num_cached_tokens,
        )


class ParallelSampling:
    """The engine's n > 1 requests: fans them out into choices, merges their outputs."""

    def __init__(self) -> None:
        self.parents: dict[str, ParentRequest] = {}
        self._parent_of: dict[str, str] = {}
        # Outputs no step produced (a choice's abort).
        self.pending: list[RequestOutput] = []

    def is_choice(self, request_id: str) -> bool:
        return request_id in self._parent_of

    def add(
        self,
        request_id: str,
        params: SamplingParams,
        base_seed: int,
        prompt,
        prompt_ids: list[int],
        final_only: bool,
        add_choice: AddChoice,
    ) -> None:
        """Queue choice 0 now (its checks stand for every choice), the rest on release."""
        kids = [
            (child_request_id(request_id, i), replace(params, n=1, seed=choice_seed(base_seed, i)))
            for i in range(params.n)
        ]
        add_choice(kids[0][0], kids[0][1], 0, False)

        def release() -> None:
            # At the front, in index order: ahead of later arrivals, while choice 0's
            # prompt blocks are certainly still cached.
            for i in range(len(kids) - 1, 0, -1):
                if kids[i][0] not in parent.done:
                    add_choice(kids[i][0], kids[i][1], i, True)

        children = {cid: i for i, (cid, _) in enumerate(kids)}
        parent = ParentRequest(request_id, prompt, prompt_ids, children, release, final_only)
        self.parents[request_id] = parent
        self._parent_of.update(dict.fromkeys(children, request_id))

    def abort(self, request_id: str, abort_one: Callable[[str], RequestOutput | None]):
        """Abort a parent (all its choices) or one choice; None when ``request_id`` is
        neither (the caller aborts it as a plain request)."""
        parent = self.parents.get(request_id)
        if parent is not None:
            outs = [out for cid in parent.children if (out := abort_one(cid)) is not None]
            parent.done.update(parent.children)  # siblings never released count as done
            self._drop(parent)
            return parent.merge(outs)
        parent = self.parents.get(self._parent_of.get(request_id, ""))
        if parent is None:
            return None
        out = abort_one(request_id)
        parent.done.add(request_id)
        if parent.children[request_id] == 0:
            parent.release()  # choice 0 gone, maybe before its first token: the rest run
        merged = parent.merge([out] if out is not None else [])
        if parent.finished:
            self._drop(parent)
        if merged is not None:
            # The parent's stream learns it too, with the next step's outputs.
            self.pending.append(merged)
        return merged

    def gather(self, produced: list[tuple[str, bool, RequestOutput | None]]) -> list[RequestOutput]:
        """A step's (request id, has tokens, output or None) -> the outputs to return:
        choices merged into their parents, siblings released once choice 0 has a token."""
        outputs, self.pending = self.pending, []
        by_parent: dict[str, list[RequestOutput]] = {}
        for rid, has_tokens, out in produced:
            pid = self._parent_of.get(rid)
            if pid is None:
                outputs.extend([out] if out is not None else [])
                continue
            parent = self.parents[pid]
            if has_tokens and parent.children[rid] == 0:
                parent.release()
            by_parent.setdefault(pid, []).extend([out] if out is not None else [])
        for pid, outs in by_parent.items():
            parent = self.parents[pid]
            merged = parent.merge(outs) if outs else None
            if parent.finished:
                self._drop(parent)
            if merged is not None:
                outputs.append(merged)
        return outputs

    def _drop(self, parent: ParentRequest) -> None:
        self.parents.pop(parent.request_id, None)
        for cid in parent.children:
            self._parent_of.pop(cid, None)
