"""The embedding-cache value format: header + raw bytes, strictly validated."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from services.embeddings.store import MAGIC, embedding_key, pack_embedding, unpack_embedding


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_pack_round_trip(dtype: torch.dtype) -> None:
    tensor = torch.randn(17, 32).to(dtype)
    value = pack_embedding(tensor)
    assert value.startswith(MAGIC)
    assert len(value) == 4 + 3 + 2 * 8 + tensor.numel() * tensor.element_size()
    assert torch.equal(unpack_embedding(value), tensor)


@pytest.mark.parametrize(
    "mutate",
    [
        lambda v: v[:5],  # shorter than the header
        lambda v: b"XXXX" + v[4:],  # bad magic
        lambda v: v[:4] + b"\x09" + v[5:],  # unknown version
        lambda v: v[:5] + b"\x63" + v[6:],  # unknown dtype code
        lambda v: v[:6] + b"\x09" + v[7:],  # too many dims
        lambda v: v[:10],  # truncated inside the shape
        lambda v: v[:-1],  # data one byte short
        lambda v: v + b"\x00",  # data one byte long
    ],
)
def test_corrupt_values_raise(mutate: Callable[[bytes], bytes]) -> None:
    value = pack_embedding(torch.zeros(2, 3))
    with pytest.raises(ValueError):
        unpack_embedding(mutate(value))


def test_key_layout_and_validation() -> None:
    digest = "ab" * 32
    assert embedding_key("qwen2vl-7b.v1", digest) == f"epd:emb:qwen2vl-7b.v1:{digest}"
    with pytest.raises(ValueError, match="image hash"):
        embedding_key("m", "AB" * 32)
    with pytest.raises(ValueError, match="image hash"):
        embedding_key("m", digest + "\n")
    with pytest.raises(ValueError, match="fingerprint"):
        embedding_key("a:b", digest)
