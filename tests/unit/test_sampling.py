"""Sampling semantics: seeded requests are batch-invariant, top-k / top-p / min-p never
emit a masked token, penalties push the right way, and every stop condition (EOS,
min_tokens, ignore_eos, stop ids, stop strings, max_tokens) ends a request as vLLM's do.
"""

from __future__ import annotations

import json
import math
import random
import shutil

import pytest
import torch

from services import LLM, SamplingParams
from services.engine.request import Request
from services.engine.sampler import apply_penalties, mask_min_tokens
from services.kernels import torch_backend
from services.kernels.metadata import SamplingTensors

MAX_NEW = 12


def _prompt(length: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1000, 30000) for _ in range(length)]


@pytest.fixture(scope="module")
def llm(llama_ckpt) -> LLM:
    return LLM(str(llama_ckpt), block_size=4, num_kv_blocks=512)


def _gen(llm: LLM, prompt: list[int], **kw):
    kw.setdefault("max_tokens", MAX_NEW)
    out = llm.generate({"prompt_token_ids": prompt}, SamplingParams(**kw))
    return out[0].outputs[0]


# ----------------------------------------------------------------- seeded sampling

TARGET = dict(temperature=0.9, top_p=0.95, seed=1234, max_tokens=8)


def _others(n: int) -> list[tuple[list[int], SamplingParams]]:
    """Neighbours with other seeds, params and prompt lengths (one shares the prompt)."""
    kinds = [
        dict(temperature=0.0),
        dict(temperature=0.7, top_k=5, seed=1),
        dict(temperature=1.3, min_p=0.05),
        dict(temperature=1.0, top_p=0.5, seed=2, presence_penalty=1.0),
        dict(temperature=0.9, top_p=0.95, seed=99, logprobs=2, repetition_penalty=1.3),
    ]
    out = [(_prompt(20, 0), SamplingParams(temperature=0.9, top_p=0.95, seed=5))]
    for i in range(1, n):
        sp = SamplingParams(max_tokens=2 + i % 7, **kinds[i % len(kinds)])
        out.append((_prompt(3 + 3 * i, 100 + i), sp))
    return out


@pytest.mark.parametrize("budget,positions", [(8192, (0, 15)), (24, (9,))])
def test_seeded_request_is_batch_invariant(llama_ckpt, budget, positions):
    """Same seed -> same tokens alone, and first, last or in the middle of a batch of 16,
    also when a small token budget splits prefills over steps (budget=24)."""
    llm = LLM(str(llama_ckpt), block_size=4, num_kv_blocks=512, max_num_batched_tokens=budget)
    prompt, params = _prompt(20, 0), SamplingParams(**TARGET)
    alone = _gen(llm, prompt, **TARGET).token_ids
    others = _others(15)
    for pos in positions:
        batch = others[:pos] + [(prompt, params)] + others[pos:]
        outs = llm.generate([{"prompt_token_ids": p} for p, _ in batch], [sp for _, sp in batch])
        assert outs[pos].outputs[0].token_ids == alone, f"differs at batch position {pos}"
        # The seed matters: the neighbour with the same prompt and seed 5 samples otherwise.
        twin = outs[batch.index(others[0])].outputs[0].token_ids
        assert twin[: len(alone)] != alone


# ----------------------------------------------------------------- masking, sampler level

LOGITS = [2.0, 1.6, 1.3, 1.1, 0.8, 0.5, 0.3, 0.0, -0.4, -0.7, -1.0, -1.5]


def _allowed(temperature: float, top_k: int, top_p: float, min_p: float) -> dict[int, float]:
    """The renormalised distribution the sampler must draw from, computed in plain Python."""
    scaled = {i: v / temperature for i, v in enumerate(LOGITS)}
    order = sorted(scaled, key=scaled.get, reverse=True)
    if top_k:
        order = order[:top_k]

    def probs(ids):
        z = sum(math.exp(scaled[i]) for i in ids)
        return {i: math.exp(scaled[i]) / z for i in ids}

    p, kept, mass = probs(order), [], 0.0
    for i in order:  # keep a token while the mass before it is below top_p
        if mass < top_p:
            kept.append(i)
        mass += p[i]
    p = probs(kept)
    best = max(p.values())
    return probs([i for i in kept if p[i] >= min_p * best])


MASK_CASES = [  # (temperature, top_k, top_p, min_p)
    (1.0, 3, 1.0, 0.0),
    (0.7, 0, 0.6, 0.0),
    (1.5, 0, 1.0, 0.2),
    (1.0, 6, 0.8, 0.3),
    (2.0, 0, 1.0, 0.0),  # no mask: every token allowed
]


def test_sampler_never_draws_a_masked_token():
    """4,000 draws per case, all cases as rows of the same batches: every token drawn is in
    the allowed set, every allowed token is drawn, frequencies match within 0.03."""
    n = 4000
    rows = [c for c in MASK_CASES for _ in range(n)]
    t = SamplingTensors(
        temperature=torch.tensor([c[0] for c in rows]),
        top_k=torch.tensor([c[1] for c in rows], dtype=torch.int32),
        top_p=torch.tensor([c[2] for c in rows]),
        min_p=torch.tensor([c[3] for c in rows]),
        seeds=torch.full((len(rows),), 7, dtype=torch.int64),
        positions=torch.arange(len(rows), dtype=torch.int64),
        all_greedy=False,
        no_top_k=False,
        no_top_p=False,
        no_min_p=False,
    )
    logits = torch.tensor(LOGITS).expand(len(rows), -1).contiguous()
    drawn = torch_backend.sample(logits, t).view(len(MASK_CASES), n)
    for case, tokens in zip(MASK_CASES, drawn, strict=True):
        allowed = _allowed(*case)
        counts = torch.bincount(tokens, minlength=len(LOGITS)).tolist()
        assert {i for i, c in enumerate(counts) if c} == set(allowed), case
        for i, p in allowed.items():
            assert abs(counts[i] / n - p) < 0.03, (case, i, counts[i] / n, p)
    assert len(_allowed(*MASK_CASES[-1])) == len(LOGITS)


def _ranked(comp):
    """(chosen Logprob, top-n Logprobs best first) per generated token."""
    for tok, lps in zip(comp.token_ids, comp.logprobs, strict=True):
        top = sorted((lp for lp in lps.values() if lp.rank is not None), key=lambda x: x.rank)
        yield lps[tok], top


def _batch(llm: LLM, n: int, **kw):
    """n prompts with seeds 0..n-1 in one batch -> their completions."""
    params = [SamplingParams(temperature=1.0, max_tokens=MAX_NEW, seed=i, **kw) for i in range(n)]
    outs = llm.generate([{"prompt_token_ids": _prompt(9, i)} for i in range(n)], params)
    return [o.outputs[0] for o in outs]


def test_engine_top_k_top_p_min_p_respect_the_mask(llm):
    """Temperature 1, so ranks and ratios of the raw logprobs are those the masks use."""
    ranks = [
        chosen.rank for comp in _batch(llm, 6, top_k=3, logprobs=5) for chosen, _ in _ranked(comp)
    ]
    assert max(ranks) <= 3 and len(set(ranks)) > 1, ranks
    for comp in _batch(llm, 4, top_p=0.004, logprobs=20):
        for chosen, top in _ranked(comp):
            top = [lp for lp in top if lp.rank <= 20]
            mass = [sum(math.exp(lp.logprob) for lp in top[:r]) for r in range(len(top) + 1)]
            assert mass[-1] >= 0.004, "top-20 too light to decide the nucleus"
            keep = sum(1 for m in mass[:-1] if m < 0.004 + 1e-6)
            assert chosen.rank <= keep
    for comp in _batch(llm, 4, min_p=0.8, logprobs=1):
        for chosen, top in _ranked(comp):
            assert chosen.logprob >= top[0].logprob + math.log(0.8) - 1e-5


# ----------------------------------------------------------------- penalties, min_tokens


def _req(prompt, output, **kw) -> Request:
    req = Request("r", list(prompt), SamplingParams(**kw), eos_token_ids=(9,))
    req.output_token_ids = list(output)
    return req


def test_penalties_move_logits_the_right_way():
    base = torch.tensor([[2.0, -1.0, 0.5, 1.0, -0.5, 3.0, 0.0, 0.2, 0.1, 0.3]])
    # Repetition: seen (prompt or output) positive logits shrink, negative ones grow more negative.
    out = apply_penalties(base.clone(), [_req([0, 1], [2], repetition_penalty=2.0)])
    assert out[0, :3].tolist() == [1.0, -2.0, 0.25]
    assert torch.equal(out[0, 3:], base[0, 3:])
    # Frequency: output tokens only, once per occurrence (token 3 twice, token 0 in the prompt).
    out = apply_penalties(base.clone(), [_req([0], [3, 3, 4], frequency_penalty=0.5)])
    assert out[0, 3].item() == pytest.approx(0.0) and out[0, 4].item() == pytest.approx(-1.0)
    assert out[0, 0].item() == 2.0
    # Presence: once per distinct output token, whatever the count; negative encourages.
    out = apply_penalties(base.clone(), [_req([], [3, 3, 4], presence_penalty=0.7)])
    assert out[0, 3].item() == pytest.approx(0.3) and out[0, 4].item() == pytest.approx(-1.2)
    out = apply_penalties(base.clone(), [_req([], [6], presence_penalty=-1.0)])
    assert out[0, 6].item() == 1.0
    # Probabilities follow: the penalised token becomes less likely, the others more.
    before = base.softmax(-1)[0]
    after = apply_penalties(base.clone(), [_req([], [5], presence_penalty=2.0)]).softmax(-1)[0]
    assert after[5] < before[5] and bool((after[:5] > before[:5]).all())


def test_min_tokens_mask_bans_eos_and_stop_ids_until_reached():
    logits = torch.zeros(3, 12)
    reqs = [
        _req([1], [4, 4], min_tokens=3, stop_token_ids=[7]),  # 2 < 3: both banned
        _req([1], [4, 4, 4], min_tokens=3, stop_token_ids=[7]),  # reached: nothing banned
        _req([1], [4], min_tokens=3, stop_token_ids=[7], ignore_eos=True),  # EOS allowed
    ]
    out = mask_min_tokens(logits, reqs)
    assert torch.isinf(out[0, [7, 9]]).all() and torch.isfinite(out[0, :7]).all()
    assert torch.isfinite(out[1]).all()
    assert torch.isinf(out[2, 7]) and torch.isfinite(out[2, 9])


# ----------------------------------------------------------------- stop conditions, engine


@pytest.fixture(scope="module")
def greedy(llm):
    """A prompt, its greedy tokens, and k: an index whose token does not occur before it."""
    prompt = _prompt(5, 0)
    tokens = _gen(llm, prompt, temperature=0).token_ids
    k = next(i for i in range(3, MAX_NEW - 3) if tokens[i] not in tokens[:i])
    return prompt, tokens, k


@pytest.fixture(scope="module")
def eos_llm(llama_ckpt, tiny_root, greedy):
    """The same weights with greedy token k declared EOS in generation_config.json."""
    _, tokens, k = greedy
    path = tiny_root / "llama-eos"
    if not path.exists():
        shutil.copytree(llama_ckpt, path)
        (path / "generation_config.json").write_text(json.dumps({"eos_token_id": tokens[k]}))
    return LLM(str(path), block_size=4, num_kv_blocks=512)


def test_eos_ignore_eos_and_min_tokens(eos_llm, greedy):
    prompt, tokens, k = greedy
    eos = tokens[k]
    comp = _gen(eos_llm, prompt, temperature=0)
    assert comp.token_ids == tokens[: k + 1]
    assert (comp.finish_reason, comp.stop_reason) == ("stop", None)
    comp = _gen(eos_llm, prompt, temperature=0, ignore_eos=True)
    assert comp.token_ids == tokens and comp.finish_reason == "length"
    comp = _gen(eos_llm, prompt, temperature=0, min_tokens=k + 3)
    assert comp.token_ids[:k] == tokens[:k] and eos not in comp.token_ids[: k + 3]
    assert len(comp.token_ids) >= k + 3


def test_stop_token_ids(llm, greedy):
    prompt, tokens, k = greedy
    comp = _gen(llm, prompt, temperature=0, stop_token_ids=[tokens[k]])
    assert comp.token_ids == tokens[: k + 1]
    assert (comp.finish_reason, comp.stop_reason) == ("stop", tokens[k])
    comp = _gen(llm, prompt, temperature=0, stop_token_ids=[tokens[k]], min_tokens=k + 2)
    assert comp.token_ids[:k] == tokens[:k] and tokens[k] not in comp.token_ids[: k + 2]


def test_max_tokens_finishes_with_length(llm, greedy):
    prompt, tokens, _ = greedy
    comp = _gen(llm, prompt, temperature=0, max_tokens=5)
    assert comp.token_ids == tokens[:5]
    assert (comp.finish_reason, comp.stop_reason) == ("length", None)


def _spanning_stop(text: str) -> str:
    """The end of one word + space + the start of the next: completed by a later token
    than the one that starts it, so a stream without hold-back would leak its head."""
    words = text.split()
    j = next(i for i in range(2, len(words) - 1) if len(words[i]) >= 3 and len(words[i + 1]) >= 2)
    return words[j][-3:] + " " + words[j + 1][:2]


def test_stop_string_truncates_and_streaming_never_leaks(llm, greedy):
    prompt, tokens, _ = greedy
    full = _gen(llm, prompt, temperature=0).text
    stop = _spanning_stop(full)
    expected = full[: full.index(stop)]
    params = SamplingParams(temperature=0, max_tokens=MAX_NEW, stop=["zzzzzz", stop])
    comp = llm.generate({"prompt_token_ids": prompt}, params)[0].outputs[0]
    assert comp.text == expected
    assert (comp.finish_reason, comp.stop_reason) == ("stop", stop)
    assert comp.token_ids == tokens[: len(comp.token_ids)] and len(comp.token_ids) < MAX_NEW

    engine = llm.engine
    engine.add_request("stream", {"prompt_token_ids": prompt}, params)
    streamed, last = "", None
    while engine.has_unfinished_requests():
        for out in engine.step():
            streamed += out.outputs[0].text_delta
            assert expected.startswith(streamed), f"leaked past the stop string: {streamed!r}"
            assert out.outputs[0].text == streamed
            last = out
    assert last.finished and streamed == expected


@pytest.mark.parametrize("n", [0, 3])
def test_logprobs_hold_top_n_and_the_chosen_token(llm, n):
    comp = _gen(llm, _prompt(7, 3), temperature=1.0, seed=3, logprobs=n)
    assert len(comp.logprobs) == len(comp.token_ids) == MAX_NEW
    for (chosen, top), tok, lps in zip(_ranked(comp), comp.token_ids, comp.logprobs, strict=True):
        assert [lp.rank for lp in top[:n]] == list(range(1, n + 1))
        assert len(lps) == n + (chosen.rank > n) and tok in lps
        assert all(a.logprob >= b.logprob for a, b in zip(top, top[1:], strict=False))
        assert all(lp.logprob <= 0 for lp in lps.values())
    total = sum(lps[t].logprob for t, lps in zip(comp.token_ids, comp.logprobs, strict=True))
    assert comp.cumulative_logprob == pytest.approx(total)
