"""The engine's speculative-decoding driver: builds the proposer, asks it for drafts
before each step, and records how many were accepted.

Per step: every running request whose only uncomputed token is its newest one (a decode)
gets up to ``k`` drafts (fewer near its ``max_tokens`` or context limit, so that all
accepted tokens fit); the scheduler schedules them with that token (spec/rollback.py),
the runner verifies them in one forward (``ModelRunner.execute_verify``, spec/verify.py).
"""

from __future__ import annotations

from collections.abc import Iterable

from services.engine.model_runner import ModelRunner
from services.engine.request import Request
from services.engine.scheduler_output import SchedulerOutput
from services.engine.spec.config import SpeculativeConfig
from services.engine.spec.metrics import SpecStats
from services.engine.spec.ngram import NgramProposer
from services.engine.spec.proposer import ProposeInput, Proposer
from services.engine.thinking import thinking_pending
from services.models.factory import LoadedModel


def make_proposer(config: SpeculativeConfig, loaded: LoadedModel, backend=None) -> Proposer:
    """The proposer the config names; a head that does not fit the target raises
    ValueError (at start-up). ``backend``: the target's kernels, which a head may use."""
    if config.method == "ngram":
        return NgramProposer(config.prompt_lookup_min, config.prompt_lookup_max)
    from services.engine.spec.eagle import Eagle3Proposer  # torch model code: on demand

    try:
        return Eagle3Proposer.load(
            config.model,
            loaded.text_config,
            loaded.device,
            loaded.dtype,
            config.parallel_drafting,
            backend=backend,
        )
    except (OSError, KeyError) as e:
        raise ValueError(f"draft head {config.model!r}: {e}") from e


class SpecDecoding:
    """Drafts before each step; the proposer's state follows the requests' lives."""

    def __init__(self, config: SpeculativeConfig, proposer: Proposer, vocab_size: int):
        self.config = config
        self.proposer = proposer
        self.k = config.num_speculative_tokens
        self.vocab_size = vocab_size
        self.stats = SpecStats()
        # Requests the proposer has seen since their last ``free`` (one free each).
        self._seen: set[str] = set()

    @classmethod
    def build(
        cls,
        config: SpeculativeConfig,
        loaded: LoadedModel,
        runner: ModelRunner,
        proposer: Proposer | None = None,
    ) -> SpecDecoding:
        """Check the proposer against the target and switch on aux capture if it asks.
        ``proposer``: one built elsewhere (tests' oracle proposers)."""
        proposer = (
            proposer if proposer is not None else make_proposer(config, loaded, runner.backend)
        )
        layers = tuple(proposer.aux_layers)
        if layers:
            if not getattr(loaded.model, "supports_aux_hidden", False):
                name = type(loaded.model).__name__
                raise ValueError(f"{name} cannot hand hidden states to a draft head")
            bad = [i for i in layers if not 0 <= i < loaded.num_layers]
            if bad:
                raise ValueError(
                    f"draft head wants layers {bad}; the target has {loaded.num_layers}"
                )
        runner.aux_layers = layers
        return cls(config, proposer, loaded.text_config.vocab_size)

    def propose(self, running: Iterable[Request], skip: set[str], runner: ModelRunner) -> None:
        """Set ``spec_token_ids`` of the running decodes (not those in ``skip``)."""
        batch, reqs, limits = [], [], []
        for req in running:
            room = min(self.k, req.max_total_tokens - req.num_tokens - 1)
            if req.num_tokens - req.num_computed_tokens != 1 or room < 1:
                continue
            if req.request_id in skip or thinking_pending(req):
                continue  # a budgeted thinking's drafts would need the budget's rollback
            hidden = runner.take_aux_rows(req.request_id) if runner.aux_layers else None
            batch.append(ProposeInput(req.request_id, req.all_token_ids, hidden))
            self._seen.add(req.request_id)
            reqs.append(req)
            limits.append(room)
        if not batch:
            return
        drafts = self.proposer.propose(batch, self.k)
        if len(drafts) != len(batch):
            raise RuntimeError(f"proposer returned {len(drafts)} lists for {len(batch)}")
        for req, tokens, limit in zip(reqs, drafts, limits, strict=True):
            tokens = self._valid(tokens)
            if req.grammar is not None:
                tokens = _grammar_drafts(req.grammar, tokens)
            req.spec_token_ids = tokens[:limit]

    def _valid(self, tokens: list[int]) -> list[int]:
        """The drafts up to the first that is no token of the target's vocabulary."""
        out = []
        for token in tokens:
            if not 0 <= int(token) < self.vocab_size:
                break
            out.append(int(token))
        return out

    def free(self, request_id: str) -> None:
        """The request finished, was aborted or preempted."""
        if request_id in self._seen:
            self._seen.discard(request_id)
            self.proposer.free(request_id)

    def observe(self, so: SchedulerOutput, emitted: dict[str, list[int]]) -> None:
        """Count one step's verifications (before any stop truncated them)."""
        for item in so.scheduled:
            tokens = emitted.get(item.request_id)
            if item.draft_token_ids and tokens:
                self.stats.observe(len(item.draft_token_ids), len(tokens) - 1)


def _grammar_drafts(grammar, proposed: list[int]) -> list[int]:
    """A constrained request's drafts: the tokens its grammar forces, when it forces some
    (accepted unless the target spells the forced text in other tokens: jump-forward at
    the price of a verification row); else the proposer's, up to the first the grammar
    refuses."""
    return grammar.forced() or grammar.valid_drafts(proposed)
