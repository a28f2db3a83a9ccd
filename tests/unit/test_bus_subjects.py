"""Subject names are built in one place and reject tokens that would break routing."""

from __future__ import annotations

import pytest

from services.bus import subjects


def test_subject_names() -> None:
    assert subjects.cache("lookup") == subjects.CACHE_LOOKUP == "epd.cache.lookup"
    # Work the router assigns: under the model's fingerprint, then the instance.
    assert subjects.prefill("fp1", "p-0") == "epd.prefill.fp1.p-0"
    assert subjects.decode("fp1", "d_1") == "epd.decode.fp1.d_1"
    assert subjects.kv("d_1") == "epd.kv.d_1"
    assert subjects.encoder("fp1", "e-0") == "epd.encoder.fp1.e-0"
    assert subjects.blob("p-0") == "epd.blob.p-0"
    assert subjects.out("gw0") == "epd.out.gw0"
    assert subjects.ABORT == "epd.abort"
    assert subjects.heartbeat("decode", "d0") == "epd.hb.decode.d0"
    assert subjects.heartbeat_wildcard("prefill") == "epd.hb.prefill.*"


@pytest.mark.parametrize("bad", ["", "a.b", "*", ">", "a b", "x\n"])
def test_rejects_tokens_that_would_change_the_subject(bad: str) -> None:
    with pytest.raises(ValueError, match="invalid"):
        subjects.decode("fp1", bad)
    with pytest.raises(ValueError, match="invalid model fingerprint"):
        subjects.prefill(bad, "p-0")


def test_rejects_unknown_role() -> None:
    with pytest.raises(ValueError, match="unknown role"):
        subjects.heartbeat("router", "r0")
