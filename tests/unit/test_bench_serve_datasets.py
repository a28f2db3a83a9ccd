"""``epd bench serve`` datasets: random-mm images and repeats, the paraphrase pair set, and the
summary's image and expected-cache figures."""

from __future__ import annotations

import base64
import io
from collections import Counter

import pytest
from PIL import Image

from launch.bench.client import RequestRecord, tag
from launch.bench.images import ImageOptions, parse_range, parse_size, random_mm_requests
from launch.bench.metrics import summarize
from launch.bench.paraphrase import kind_counts, load_pairs, paraphrase_requests, parse_mix


def _images(req) -> list[str]:
    return [p["image_url"]["url"] for p in req.messages[0]["content"] if p["type"] == "image_url"]


def _decode(url: str) -> Image.Image:
    head, _, data = url.partition(",")
    assert head in ("data:image/png;base64", "data:image/jpeg;base64")
    return Image.open(io.BytesIO(base64.b64decode(data)))


def test_random_mm_counts_repeats_and_never_repeats_within_a_request() -> None:
    opts = ImageOptions(per_request=(1, 4), repeat_ratio=0.8, sizes=((32, 24), (16, 16)))
    reqs = random_mm_requests(300, input_len=8, output_len=4, range_ratio=0.0, seed=2, opts=opts)
    assert reqs == random_mm_requests(300, 8, 4, 0.0, seed=2, opts=opts)
    seen: set[str] = set()
    repeats = 0
    for r in reqs:
        urls = _images(r)
        assert 1 <= len(urls) <= 4 and len(set(urls)) == len(urls) == r.images
        assert r.image_repeats == sum(u in seen for u in urls)  # the count the record carries
        repeats += r.image_repeats
        seen.update(urls)
        assert r.messages[0]["content"][-1] == {"type": "text", "text": r.prompt}
    slots = sum(r.images for r in reqs)
    assert Counter(len(_images(r)) for r in reqs).keys() == {1, 2, 3, 4}
    # Every slot but the very first may repeat, each with probability 0.8.
    assert repeats / slots == pytest.approx(0.8, abs=0.04)
    assert len(seen) == slots - repeats  # a fresh image is never byte-equal to an older one
    assert {_decode(u).size for u in seen} == {(32, 24), (16, 16)}


def test_random_mm_without_repeats_sends_every_image_once_as_jpeg() -> None:
    opts = ImageOptions(per_request=(2, 2), repeat_ratio=0.0, image_format="jpeg")
    reqs = random_mm_requests(5, 4, 4, 0.0, seed=0, opts=opts)
    urls = [u for r in reqs for u in _images(r)]
    assert len(urls) == len(set(urls)) == 10 and sum(r.image_repeats for r in reqs) == 0
    assert {_decode(u).format for u in urls} == {"JPEG"}
    assert {_decode(u).size for u in urls} == {(224, 224)}


def test_image_flags_are_parsed_and_checked() -> None:
    assert parse_size("640x480") == (640, 480) and parse_range("1..4") == (1, 4)
    assert parse_range("3") == (3, 3)
    for bad in ("640", "0x4", "ax3"):
        with pytest.raises(ValueError):
            parse_size(bad)
    for bad in ("0..2", "3..1", "x"):
        with pytest.raises(ValueError):
            parse_range(bad)
    with pytest.raises(ValueError):
        random_mm_requests(1, 4, 4, 0.0, seed=0, opts=ImageOptions(repeat_ratio=1.5))


def test_paraphrase_asks_every_seed_before_its_follow_up_in_the_mix() -> None:
    reqs = paraphrase_requests(200, output_len=8, seed=4)
    assert reqs == paraphrase_requests(200, 8, seed=4)
    seeds, follow = reqs[:100], reqs[100:]
    assert {r.kind for r in seeds} == {"seed"} and all(r.expect == "miss" for r in seeds)
    kinds = Counter(r.kind.split("/")[0] for r in follow)
    assert kinds == {"repeat": 30, "paraphrase": 50, "negative": 20}
    assert len({r.prompt for r in seeds}) == 100  # distinct seeds: none is another's repeat
    pairs = {(p["a"], p["b"]): p for p in load_pairs()}
    for seed, f in zip(seeds, follow, strict=True):
        if f.kind == "repeat":
            assert (f.prompt, f.expect) == (seed.prompt, "hit")
            continue
        row = pairs[(seed.prompt, f.prompt)]  # the follow-up is its seed's pair
        assert f.expect == row["label"]
        assert f.kind == ("paraphrase" if row["label"] == "hit" else f"negative/{row['kind']}")
    assert all(r.max_tokens == 8 for r in reqs)


def test_paraphrase_mix_is_parsed_and_split_exactly() -> None:
    assert parse_mix("repeat:1,paraphrase:3") == {"repeat": 0.25, "paraphrase": 0.75}
    assert kind_counts(7, {"repeat": 0.3, "paraphrase": 0.5, "negative": 0.2}) == {
        "repeat": 2,
        "paraphrase": 4,
        "negative": 1,
    }  # 2.1, 3.5, 1.4
    for bad in ("hits:1", "repeat", "repeat:-1", "repeat:0"):
        with pytest.raises(ValueError):
            parse_mix(bad)
    odd = paraphrase_requests(5, 4, seed=0, mix="negative:1")
    assert [r.kind.split("/")[0] for r in odd] == ["seed"] * 3 + ["negative"] * 2
    with pytest.raises(ValueError):  # more negatives than the set has distinct seeds for
        paraphrase_requests(800, 4, seed=0, mix="negative:1")


def _done(req, cache: str, ttft_ms: float, e2e_ms: float) -> RequestRecord:
    rec = RequestRecord(
        send_s=1.0,
        end_s=1.0 + e2e_ms / 1000,
        chunk_s=[1.0 + ttft_ms / 1000],
        chunk_tokens=[1],
        output_tokens=1,
        cache=cache,
    )
    return tag(rec, req)


def test_summary_counts_hits_by_kind_false_hits_and_missed_hits() -> None:
    reqs = paraphrase_requests(200, 4, seed=0)
    seed, follow = reqs[0], reqs[100:]
    rep = next(r for r in follow if r.kind == "repeat")
    para = next(r for r in follow if r.kind == "paraphrase")
    neg = next(r for r in follow if r.kind.startswith("negative/"))
    recs = [
        _done(seed, "miss", 200, 400),
        _done(seed, "miss", 300, 500),
        _done(rep, "hit-exact", 4, 6),
        _done(para, "hit-semantic", 10, 12),
        _done(para, "miss", 220, 420),
        _done(neg, "hit-semantic", 8, 10),
        _done(neg, "miss", 240, 440),
    ]
    exp = summarize(recs, duration_s=1.0)["expected_cache"]
    assert exp["kinds"]["seed"] == {
        "requests": 2,
        "hits": 0,
        "expected_hits": 0,
        "ttft_p50_ms": pytest.approx(250),
        "e2el_p50_ms": pytest.approx(450),
    }
    assert exp["kinds"]["repeat"] == {
        "requests": 1,
        "hits": 1,
        "expected_hits": 1,
        "ttft_p50_ms": pytest.approx(4),
        "e2el_p50_ms": pytest.approx(6),
    }
    assert (
        exp["kinds"]["paraphrase"]["hits"] == 1 and exp["kinds"]["paraphrase"]["expected_hits"] == 2
    )
    assert exp["kinds"]["negative"]["hits"] == 1 and exp["kinds"]["negative"]["expected_hits"] == 0
    assert exp["false_hits"] == 1 and exp["false_hits_by_kind"] == {neg.kind: 1}
    assert exp["missed_hits"] == 1


def test_summary_counts_image_slots_and_repeats() -> None:
    opts = ImageOptions(per_request=(1, 3), repeat_ratio=0.5, sizes=((8, 8),))
    reqs = random_mm_requests(20, 4, 4, 0.0, seed=1, opts=opts)
    recs = [_done(r, "miss", 10, 20) for r in reqs]
    assert summarize(recs, 1.0)["images"] == {
        "slots": sum(r.images for r in reqs),
        "repeats": sum(r.image_repeats for r in reqs),
    }
    assert "images" not in summarize(recs[:0], 1.0) and "expected_cache" not in summarize(recs, 1.0)
