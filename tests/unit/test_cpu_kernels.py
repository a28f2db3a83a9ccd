"""Native CPU kernels (``services/kernels/csrc/``) against their torch twins.

The cpu backend must give what the torch backend gives, for every op it replaces, on
shapes that reach each code path: GEMV (1-4 rows), oneDNN GEMM (8+ rows), F.linear
between; head sizes that are and are not multiples of the kernels' vector width; decode
rows mixed with prefill rows; one and two threads; and fallbacks for other dtypes.
"""

import ctypes
import math
import platform
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from services.kernels import cpu_native
from services.kernels import torch_backend as ref
from services.kernels.backend import get_backend
from services.kernels.metadata import AttentionMetadata
from tests.helpers.threads import set_threads

TOL = {"atol": 1e-5, "rtol": 1e-4}


threads = pytest.fixture(params=[1, 2], ids=["1-thread", "2-threads"])(set_threads)


def _meta(query_lens, seq_lens, num_blocks, bs, gen) -> AttentionMetadata:
    b = len(seq_lens)
    width = max(math.ceil(s / bs) for s in seq_lens)
    wide = torch.zeros(b, width + 2, dtype=torch.int32)
    ids, used = torch.randperm(num_blocks, generator=gen), 0
    for i, s in enumerate(seq_lens):
        n = math.ceil(s / bs)
        wide[i, 2 : 2 + n] = ids[used : used + n].to(torch.int32)
        used += n
    qsl = [0]
    for q in query_lens:
        qsl.append(qsl[-1] + q)
    return AttentionMetadata(
        query_start_loc=torch.tensor(qsl, dtype=torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        block_tables=wide[:, 2:],  # strided, like a slice of a wider table
        slot_mapping=torch.zeros(sum(query_lens), dtype=torch.int64),
        max_query_len=max(query_lens),
        max_seq_len=max(seq_lens),
        query_lens_cpu=list(query_lens),
        seq_lens_cpu=list(seq_lens),
    )


# GQA groups of 1, 2, 3, 5 and 8 at head size 64 and 128: every way the decode kernel
# groups heads (a pair per key read; whole groups of 1-4 per V read, larger ones in parts).
@pytest.mark.parametrize(
    "hq,hkv,d",
    [
        (8, 4, 64),
        (16, 2, 128),
        (12, 4, 64),
        (4, 4, 16),
        (6, 2, 40),
        (8, 8, 64),
        (16, 2, 64),
        (10, 2, 64),
        (8, 8, 128),
    ],
)
def test_attention_matches_torch_on_mixed_batches(be, threads, hq, hkv, d):
    gen = torch.Generator().manual_seed(hq * d)
    bs, nb = 16, 64
    query_lens, seq_lens = [1, 5, 1, 1, 9, 1], [37, 20, 1, 130, 9, 16]
    meta = _meta(query_lens, seq_lens, nb, bs, gen)
    kc = torch.randn(nb, bs, hkv, d, generator=gen)
    vc = torch.randn(nb, bs, hkv, d, generator=gen)
    q = torch.randn(sum(query_lens), hq, d, generator=gen)
    want = ref.attention(q, kc, vc, meta, d**-0.5)
    got = be.attention(q, kc, vc, meta, d**-0.5)
    torch.testing.assert_close(got, want, **TOL)


def test_attention_long_contexts_and_many_sequences(be, threads):
    """Decode rows up to 700 tokens, prefill chunks of 1,000 and 1,500 tokens of context
    (the tile kernel serves both)."""
    gen = torch.Generator().manual_seed(7)
    lens = [int(x) for x in torch.randint(1, 700, (40,), generator=gen)]
    query_lens, lens = [1] * 40 + [30, 12], lens + [1500, 1000]
    meta = _meta(query_lens, lens, 2048, 16, gen)
    kc, vc = torch.randn(2, 2048, 16, 2, 64, generator=gen)
    q = torch.randn(sum(query_lens), 8, 64, generator=gen)
    torch.testing.assert_close(
        be.attention(q, kc, vc, meta, 0.125), ref.attention(q, kc, vc, meta, 0.125), **TOL
    )


def test_attention_rejects_tables_that_would_read_out_of_bounds(be):
    gen = torch.Generator().manual_seed(1)
    kc, vc = torch.randn(2, 8, 16, 2, 64, generator=gen)
    q = torch.randn(1, 4, 64, generator=gen)
    meta = _meta([1], [20], 8, 16, gen)
    meta.block_tables[0, 1] = 8  # one past the last block
    with pytest.raises(ValueError, match="block id"):
        be.attention(q, kc, vc, meta, 0.125)
    meta = _meta([1], [20], 8, 16, gen)
    meta.seq_lens_cpu = [40]  # longer than the 2 blocks the table holds
    with pytest.raises(ValueError, match="longer than its block table"):
        be.attention(q, kc, vc, meta, 0.125)


@pytest.mark.parametrize("rows", [1, 3, 4, 6, 8, 33])
@pytest.mark.parametrize("layout", ["column-major", "row-major"])
@pytest.mark.parametrize("bias", [False, True])
def test_linear_matches_f_linear(be, threads, rows, layout, bias):
    gen = torch.Generator().manual_seed(rows)
    w = torch.randn(3000, 70, generator=gen)  # odd k: the GEMV's tail rows
    if layout == "column-major":
        w = w.t().contiguous().t()
    b = torch.randn(3000, generator=gen) if bias else None
    x = torch.randn(rows, 70, generator=gen)
    torch.testing.assert_close(be.linear(x, w, b), F.linear(x, w, b), atol=1e-4, rtol=1e-4)


def test_linear_on_a_strided_weight_falls_back(be):
    """Neither W^T nor W contiguous (a column slice): torch's op, same numbers."""
    gen = torch.Generator().manual_seed(9)
    w = torch.randn(300, 140, generator=gen)[:, ::2]
    x = torch.randn(2, 70, generator=gen)
    torch.testing.assert_close(be.linear(x, w), F.linear(x, w), atol=1e-4, rtol=1e-4)
    assert torch.equal(be.greedy_head(x, w), F.linear(x, w).argmax(dim=-1))


def test_silu_mul_and_rms_norm(be, threads):
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(300, 2 * 77, generator=gen) * 6  # large |x|: exp's range reduction
    torch.testing.assert_close(be.silu_mul(x), ref.silu_mul(x), **TOL)
    h, r, w = torch.randn(3, 300, 77, generator=gen)
    torch.testing.assert_close(be.rms_norm(h, w[0], 1e-6), ref.rms_norm(h, w[0], 1e-6), **TOL)
    got, want = be.rms_norm(h, w[0], 1e-6, r), ref.rms_norm(h, w[0], 1e-6, r)
    torch.testing.assert_close(got[0], want[0], **TOL)
    torch.testing.assert_close(got[1], want[1], **TOL)


@pytest.mark.parametrize("neox", [True, False])
@pytest.mark.parametrize("rot", [32, 16])
def test_rotary_in_place(be, threads, neox, rot):
    gen = torch.Generator().manual_seed(rot)
    pos = torch.randint(0, 100, (300,), generator=gen)
    cs = torch.randn(100, rot, generator=gen)
    q, k = torch.randn(300, 4, 32, generator=gen), torch.randn(300, 2, 32, generator=gen)
    q2, k2 = q.clone(), k.clone()
    be.rotary(pos, q, k, cs, neox)
    ref.rotary(pos, q2, k2, cs, neox)
    torch.testing.assert_close(q, q2, **TOL)
    torch.testing.assert_close(k, k2, **TOL)
    with pytest.raises(IndexError, match="position"):
        be.rotary(pos + 100, q, k, cs, neox)


def test_greedy_sampling_is_torch_argmax(be, threads):
    gen = torch.Generator().manual_seed(5)
    logits = torch.randn(37, 1001, generator=gen)
    logits[3, 17] = logits[3, 900] = 50.0  # a tie: the first index wins, as in torch
    logits[4] = float("-inf")
    t = SimpleNamespace(all_greedy=True)
    assert torch.equal(be.sample(logits, t), logits.argmax(dim=-1))


@pytest.mark.parametrize("rows", [1, 4, 6])
@pytest.mark.parametrize("layout", ["column-major", "row-major"])
def test_greedy_head_is_the_logits_argmax(be, threads, rows, layout):
    """One native call at one thread (GEMV rows, either layout); linear + argmax otherwise."""
    gen = torch.Generator().manual_seed(rows)
    w = torch.randn(3001, 70, generator=gen)
    w[1500] = w[7]  # a tie between two vocabulary rows: the first index wins
    if layout == "column-major":
        w = w.t().contiguous().t()
    x = torch.randn(rows, 70, generator=gen)
    x[0] = w[7] * 10  # row 0's top logit is the tie
    want = be.linear(x, w).argmax(dim=-1)
    assert want[0] == 7
    assert torch.equal(be.greedy_head(x, w), want)
    assert torch.equal(ref.greedy_head(x, w), F.linear(x, w).argmax(dim=-1))


def test_other_dtypes_fall_back_to_torch(be):
    x = torch.randn(5, 2 * 8, dtype=torch.bfloat16)
    assert torch.equal(be.silu_mul(x), ref.silu_mul(x))
    w = torch.randn(8, 16, dtype=torch.bfloat16)
    assert torch.equal(be.linear(x, w), F.linear(x, w))


def test_without_a_compiler_auto_serves_with_torch(tmp_path):
    cc = str(tmp_path / "no-such-cc")
    assert cpu_native.load(tmp_path, cc) is None
    assert get_backend("auto", torch.device("cpu"), str(tmp_path), cc).name == "torch"
    with pytest.raises(ValueError, match="did not build"):
        get_backend("cpu", torch.device("cpu"), str(tmp_path), cc)


def test_a_compiler_that_fails_leaves_the_torch_backend(tmp_path):
    cc = tmp_path / "broken-cc"
    cc.write_text("#!/bin/sh\necho 'cc: broken' >&2\nexit 1\n")
    cc.chmod(0o755)
    assert cpu_native.load(tmp_path, str(cc)) is None
    assert get_backend("auto", torch.device("cpu"), str(tmp_path), str(cc)).name == "torch"


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc's mallopt only")
def test_glibc_keeps_freed_memory_for_the_next_step():
    assert cpu_native.keep_freed_memory()


def test_the_kernels_run_on_torchs_own_openmp_runtime(be):
    """epd_parallel.c splits ops over torch's OpenMP team: the library is built with OpenMP
    and its OpenMP calls bind the libgomp torch loaded, not a copy with its own threads
    (other packages may bring theirs under other names)."""
    assert be.lib.epd_openmp() == 1
    bundled = Path(torch.__file__).parent / "lib" / "libgomp.so.1"
    torchs = ctypes.CDLL(str(bundled) if bundled.exists() else "libgomp.so.1")
    address = lambda lib: ctypes.cast(lib.GOMP_parallel, ctypes.c_void_p).value  # noqa: E731
    assert address(be.lib) == address(torchs)
