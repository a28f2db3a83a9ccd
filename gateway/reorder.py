"""Token updates come from two publishers (prefill: token 1, decode: the rest); put them
back in order by their offset before anyone sees them."""

from __future__ import annotations

from gateway.events import TokenEvent
from protos.epd_pb import bus_pb2
from services.wire import FINISH_FROM_PROTO, logprobs_from_proto


class UpdateOrderer:
    """One choice's updates in order, across its attempts (a migrated request resumes
    at the offset the client reached)."""

    def __init__(self):
        self.next_offset = 0
        self.pending: dict[int, bus_pb2.TokenUpdate] = {}
        self.num_cached_tokens = 0
        self.attempt_start = 0

    def begin(self, start: int) -> None:
        """A new attempt whose first token sits at ``start`` (= tokens delivered)."""
        self.next_offset = self.attempt_start = start
        self.pending.clear()

    @property
    def started(self) -> bool:
        """The attempt's first token has arrived (decode owns the request from then on)."""
        return self.next_offset > self.attempt_start

    def push(self, upd: bus_pb2.TokenUpdate) -> list[bus_pb2.TokenUpdate]:
        """Updates now in order (an error jumps the queue)."""
        if upd.HasField("error"):
            return [upd]
        if upd.offset < self.next_offset:
            return []  # duplicate
        self.pending.setdefault(upd.offset, upd)  # the first word at an offset stands
        ready = []
        while self.next_offset in self.pending:
            u = self.pending.pop(self.next_offset)
            ready.append(u)
            self.next_offset += max(len(u.token_ids), 1)
        return ready

    def event(self, upd: bus_pb2.TokenUpdate) -> TokenEvent:
        if self.attempt_start == 0:  # a resumed prefill's cache hits are not the client's
            self.num_cached_tokens = max(self.num_cached_tokens, upd.num_cached_tokens)
        lps = [
            logprobs_from_proto(t, lp) for t, lp in zip(upd.token_ids, upd.logprobs, strict=False)
        ]
        stop_reason = upd.stop_token_id if upd.HasField("stop_token_id") else None
        return TokenEvent(
            list(upd.token_ids),
            lps,
            FINISH_FROM_PROTO.get(upd.finish_reason),
            stop_reason,
            self.num_cached_tokens,
        )
