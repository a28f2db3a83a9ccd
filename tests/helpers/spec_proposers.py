"""Test proposers for speculative decoding: an oracle that proposes the target's own
greedy continuation (everything accepted), a partly right one (every acceptance count
from 0 to k occurs) and a deliberately wrong one. They record the hidden rows they are
handed, so tests can check the engine's side of the ``Proposer`` contract."""

from __future__ import annotations

import torch

from services.engine.spec.proposer import ProposeInput


class OracleProposer:
    """Proposes the continuation of whichever reference sequence extends the tokens.

    ``references``: full token sequences (prompt + the target's greedy output).
    ``right``: how many leading drafts are right, as a function of the request's length
    (the rest are off by one); None: all right. ``aux_layers``: asks for hidden rows.
    """

    def __init__(
        self,
        references: list[list[int]],
        vocab_size: int,
        right=None,
        aux_layers: tuple[int, ...] = (),
    ):
        self.references = references
        self.vocab_size = vocab_size
        self.right = right
        self.aux_layers = aux_layers
        # request id -> [(first position, rows)] of every hidden block delivered
        self.hidden: dict[str, list[tuple[int, torch.Tensor]]] = {}
        self.freed: list[str] = []
        # ("rows", request id, first position) and ("free", request id, -1), in order
        self.events: list[tuple[str, str, int]] = []

    def propose(self, batch: list[ProposeInput], k: int) -> list[list[int]]:
        out = []
        for item in batch:
            if item.hidden is not None and item.hidden.shape[0]:
                first = len(item.token_ids) - 1 - item.hidden.shape[0]
                self.hidden.setdefault(item.request_id, []).append((first, item.hidden.clone()))
                self.events.append(("rows", item.request_id, first))
            out.append(self._drafts(item.token_ids, k))
        return out

    def _drafts(self, tokens: list[int], k: int) -> list[int]:
        n = len(tokens)
        for ref in self.references:
            if ref[:n] == tokens:
                drafts = ref[n : n + k]
                good = len(drafts) if self.right is None else min(self.right(n), len(drafts))
                return drafts[:good] + [(t + 1) % self.vocab_size for t in drafts[good:]]
        return []

    def free(self, request_id: str) -> None:
        self.freed.append(request_id)
        self.events.append(("free", request_id, -1))


class WrongProposer:
    """Always proposes the same token ``k`` times (a draft distribution unlike the
    target's)."""

    aux_layers: tuple[int, ...] = ()

    def __init__(self, token: int):
        self.token = token

    def propose(self, batch: list[ProposeInput], k: int) -> list[list[int]]:
        return [[self.token] * k for _ in batch]

    def free(self, request_id: str) -> None:
        pass


class RecordingProposer:
    """Proposes nothing; records the hidden rows it is handed: [(request id, first
    position, rows, token ids)] in order."""

    def __init__(self, aux_layers: tuple[int, ...]):
        self.aux_layers = aux_layers
        self.rows: list[tuple[str, int, torch.Tensor, list[int]]] = []

    def propose(self, batch: list[ProposeInput], k: int) -> list[list[int]]:
        for item in batch:
            if item.hidden is not None:
                first = len(item.token_ids) - 1 - item.hidden.shape[0]
                self.rows.append(
                    (item.request_id, first, item.hidden.clone(), list(item.token_ids))
                )
        return [[] for _ in batch]

    def free(self, request_id: str) -> None:
        pass
