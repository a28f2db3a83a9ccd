"""Step 2 of the request path: the semantic response cache, seen from the gateway.

The gateway decides what may be cached and under which fingerprint; the cache service
(cache_svc/, over the bus, or in this process for ``epd serve all``) finds and stores
answers. A request is looked up when it is greedy (or ``cache_sampled`` is on), asks for
no logprobs and did not opt out; a lookup that takes longer than
``cache_lookup_timeout_ms`` or fails is a miss, never an error. Only answers that
finished (stop or length) are stored, in the background. The clients that reach the
cache service are in cache_client.py.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import json
import logging
from collections.abc import AsyncIterator

from cache_svc.config import SemanticCacheConfig
from gateway.cache_client import CacheClient
from gateway.events import TokenEvent
from gateway.prepare import PreparedRequest
from gateway.stream import OutputStream
from protos.epd_pb import bus_pb2
from services.bus import subjects
from services.metrics import GATEWAY_CACHE
from services.wire import FINISH_FROM_PROTO, FINISH_TO_PROTO

log = logging.getLogger(__name__)

_REPLAY_CHUNK = 16  # tokens per streamed chunk of a cached answer
_NOT_KEYED = ("max_tokens", "detokenize", "seed")  # max_tokens: see cache_svc fits()


class ResponseCache:
    def __init__(self, client: CacheClient, config: SemanticCacheConfig, model_fingerprint: str):
        self.client, self.config, self.model = client, config, model_fingerprint
        self._tasks: set[asyncio.Task] = set()
        # Full lookups sent by head_start, by id() of their request.
        self._early: dict[int, asyncio.Future] = {}

    def query(self, prep: PreparedRequest, reading: bool = True) -> bus_pb2.CacheQuery | None:
        """The request as the cache sees it; None when it may not be cached (``reading``:
        looked up; a no-cache request is only stored)."""
        sp = prep.params
        if prep.cache_mode == "bypass" or prep.cache_opt_out or sp.logprobs is not None:
            return None
        if reading and prep.cache_mode == "no-cache":
            return None
        if not (sp.greedy or self.config.cache_sampled):
            return None
        text, context = _split(prep)
        if prep.parsers.tools is not None:
            # A tool call's arguments come from the question's own words: a paraphrase
            # must not get them. Exact hits only (no text: no semantic index).
            text = ""
        keyed = {k: v for k, v in dataclasses.asdict(sp).items() if k not in _NOT_KEYED}
        fingerprint = _sha(
            {
                "model": self.model,
                "chat": prep.messages is not None,
                "chat_options": prep.chat_key,
                "context": context,
                "images": [s.image_hash for s in prep.spans],
                "params": keyed,
                "tenant": prep.tenant,
            }
        )
        exact = _sha({"fingerprint": fingerprint, "prompt": prep.prompt_token_ids})
        return bus_pb2.CacheQuery(
            fingerprint=fingerprint,
            exact_key=exact,
            text=text,
            max_tokens=sp.max_tokens or 0,
            tenant=prep.tenant,
            vector=prep.text_vector if text else b"",
        )

    async def lookup(
        self, prep: PreparedRequest, query_of: bus_pb2.CacheQuery, exact_only: bool
    ) -> bus_pb2.CachedAnswer | None:
        """The cached answer of a request, if any (sets ``prep.cache_status``). An
        exact-only lookup counts only its hits: the full one follows a miss (the one
        ``head_start`` sent, when it did)."""
        if exact_only:
            reply = await self._ask(query_of, True)
            if reply is not None and not reply.hit and _usable_replica(reply.embedding_on):
                prep.cache_replica = reply.embedding_on
            return self._answer(prep, reply, exact_only)
        early = self._early.pop(id(prep), None)
        if early is None:
            early = self._ask(query_of, False, prep.cache_replica)
        reply = await early
        return self._answer(prep, reply, exact_only)

    async def head_start(
        self, prep: PreparedRequest, query_of: bus_pb2.CacheQuery
    ) -> bus_pb2.CachedAnswer | None:
        """After an exact miss: the full lookup's hit if it comes within the head start
        (the workers then never start: no prefill competes with the lookup for the
        cores, none is thrown away); else None, and the lookup goes on beside the
        workers (``lookup(exact_only=False)`` takes it up). Sent only after the exact
        miss: sent with the exact query, its embedding delayed the exact reply that the
        workers wait for (+20 ms a miss, cache service on one core)."""
        wait_s = self.head_start_s()
        if wait_s <= 0 or not query_of.text:
            return None
        early = self._early[id(prep)] = asyncio.ensure_future(
            self._ask(query_of, False, prep.cache_replica)
        )
        try:
            done, _ = await asyncio.wait({early}, timeout=wait_s)
        except BaseException:
            self._drop_early(prep)
            raise
        reply = early.result() if done else None
        if reply is None or reply.HasField("error") or not reply.hit:
            return None  # counted by the lookup that follows
        self._early.pop(id(prep), None)
        return self._answer(prep, reply, exact_only=False)

    def head_start_s(self) -> float:
        """``cache_head_start_ms``, "auto" resolved: the lookup's timeout when the client
        says to ask first, else 0 (docs/semantic-cache.md, "A lookup")."""
        ms = self.config.cache_head_start_ms
        if ms is None:
            ms = self.config.cache_lookup_timeout_ms if self.client.ask_first() else 0.0
        return ms / 1e3

    def _drop_early(self, prep: PreparedRequest) -> None:
        early = self._early.pop(id(prep), None)
        if early is not None:
            early.cancel()

    async def _ask(
        self, query_of: bus_pb2.CacheQuery, exact_only: bool, replica: str = ""
    ) -> bus_pb2.CacheLookupReply | None:
        """The cache's reply (from ``replica`` if named); None when it is slow or gone
        (the engine serves it)."""
        query = bus_pb2.CacheQuery(exact_only=exact_only)
        query.MergeFrom(query_of)
        timeout_s = self.config.cache_lookup_timeout_ms / 1e3
        if exact_only:  # it holds the workers back: a slow cache must not
            timeout_s = min(timeout_s, self.config.cache_exact_timeout_ms / 1e3)
        try:
            return await self.client.lookup(query, timeout_s, replica)
        except Exception as e:
            log.debug("cache lookup failed: %r", e)
            return None

    def _answer(
        self, prep: PreparedRequest, reply: bus_pb2.CacheLookupReply | None, exact_only: bool
    ) -> bus_pb2.CachedAnswer | None:
        if reply is None or reply.HasField("error") or not reply.hit:
            if not exact_only:
                failed = reply is None or reply.HasField("error")
                GATEWAY_CACHE.labels("unavailable" if failed else "miss").inc()
            return None
        GATEWAY_CACHE.labels(f"hit_{reply.tier}").inc()
        prep.cache_status, prep.cache_similarity = f"hit-{reply.tier}", reply.similarity
        return reply.answer

    def store(self, prep: PreparedRequest, streams: list[OutputStream]) -> None:
        """Store a finished answer in the background (nothing waits for it)."""
        if prep.cache_mode in ("no-store", "bypass") or prep.cache_status != "miss":
            return
        if any(s.state.finish_reason not in ("stop", "length") for s in streams):
            return
        query = self.query(prep, reading=False)
        if query is None:
            return
        answer = bus_pb2.CachedAnswer(max_tokens=prep.params.max_tokens or 0)
        for s in streams:
            choice = answer.choices.add(
                index=s.index,
                token_ids=s.token_ids,
                finish_reason=FINISH_TO_PROTO[s.state.finish_reason],
            )
            reason = s.state.stop_reason
            if isinstance(reason, int):
                choice.stop_token_id = reason
            elif isinstance(reason, str):
                choice.stop_string = reason
        task = asyncio.create_task(
            self._store(bus_pb2.CacheStoreRequest(query=query, answer=answer))
        )
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _store(self, req: bus_pb2.CacheStoreRequest) -> None:
        try:
            await self.client.store(req, self.config.cache_store_timeout_ms / 1e3)
        except Exception as e:
            log.debug("cache store failed: %r", e)


async def replay(answer: bus_pb2.CachedAnswer, prompt_len: int) -> AsyncIterator[TokenEvent]:
    """A cached answer as the events a backend would send (a few tokens at a time)."""
    for choice in answer.choices:
        ids = list(choice.token_ids)
        stop = (
            choice.stop_token_id if choice.HasField("stop_token_id") else choice.stop_string or None
        )
        for start in range(0, max(len(ids), 1), _REPLAY_CHUNK):
            last = start + _REPLAY_CHUNK >= len(ids)
            yield TokenEvent(
                ids[start : start + _REPLAY_CHUNK],
                [],
                FINISH_FROM_PROTO[choice.finish_reason] if last else None,
                stop if last else None,
                prompt_len,
                choice.index,
            )


def _split(prep: PreparedRequest) -> tuple[str, list]:
    """(the last user message's text, everything before it) of a chat; a completion's
    prompt text and no context."""
    if prep.messages is None:
        return prep.prompt_text or "", []
    *context, last = prep.messages
    if last.get("role") != "user":
        return "", [*context, _plain(last)]
    return _text(last.get("content")), [_plain(m) for m in context]


def _text(content) -> str:
    if isinstance(content, str):
        return content
    return " ".join(p.get("text", "") for p in content or [] if p.get("type") == "text")


def _plain(message: dict) -> dict:
    content = message.get("content")
    if isinstance(content, list):
        content = [p if p.get("type") == "text" else {"type": "image"} for p in content]
    tools = {k: message[k] for k in ("tool_calls", "tool_call_id", "name") if k in message}
    return {"role": message.get("role"), "content": content, **tools}


def _usable_replica(name: str) -> bool:
    """A replica name from the bus that can be a subject token (else it is ignored)."""
    try:
        return 0 < len(name) <= 128 and subjects.check_token(name) == name
    except ValueError:
        return False


def _sha(obj) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()
