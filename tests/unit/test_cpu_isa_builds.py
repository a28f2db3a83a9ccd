"""The native kernels built for a plain AVX2 CPU give the bits of the build for this one.

The library is compiled with ``-march=native``, so the machines the tests run on (AVX-512)
never run the attention kernels' eight-lane paths, which serve every CPU without AVX-512.
Both kernels sum each lane in the same order whatever the vector width: this builds the
library again for x86-64-v3 (AVX2 + FMA) and compares the attention of both, bit for bit.
"""

import ctypes
import platform
import shutil
import subprocess

import pytest
import torch

from services.kernels import cpu_native
from services.kernels.cpu_attention import AttentionPlan
from tests.unit.test_cpu_kernels import _meta

_AVX2 = torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512")
pytestmark = pytest.mark.skipif(
    platform.machine() not in ("x86_64", "AMD64") or not _AVX2,
    reason="an x86-64 CPU with AVX2 runs both builds",
)


@pytest.fixture(scope="module")
def libs(tmp_path_factory):
    """(this CPU's build, the x86-64-v3 build), single-threaded entry points typed."""
    cc = shutil.which("cc")
    if cc is None:
        pytest.skip("no C compiler")
    out = tmp_path_factory.mktemp("isa") / "epd_v3.so"
    flags = [f if f != "-march=native" else "-march=x86-64-v3" for f in cpu_native.FLAGS]
    cmd = [cc, *flags, *cpu_native.OPENMP, "-o", str(out), *map(str, cpu_native.SOURCES), "-lm"]
    subprocess.run(cmd, check=True, capture_output=True, timeout=120)
    native = cpu_native.load(tmp_path_factory.mktemp("native"))
    built = []
    for lib in (native, ctypes.CDLL(str(out))):
        for name in ("epd_decode_attention", "epd_extend_attention"):
            res, args = cpu_native._SIGNATURES[name]
            fn = getattr(lib, name)
            fn.restype, fn.argtypes = res, args
        built.append(lib)
    return built


def _inputs(hq, hkv, d, query_lens, seq_lens, seed):
    gen = torch.Generator().manual_seed(seed)
    nb = sum(-(-s // 16) for s in seq_lens) + 4
    meta = _meta(query_lens, seq_lens, nb, 16, gen)
    kc, vc = torch.randn(2, nb, 16, hkv, d, generator=gen)
    q = torch.randn(sum(query_lens), hq, d, generator=gen)
    return q, kc, vc, meta, AttentionPlan(meta, kc, hq)


@pytest.mark.parametrize(
    "hq,hkv,d", [(8, 4, 64), (8, 8, 64), (10, 2, 64), (16, 2, 128), (8, 8, 128), (6, 2, 48)]
)
def test_decode_attention_is_the_same_on_avx2(libs, hq, hkv, d):
    q, kc, vc, meta, plan = _inputs(hq, hkv, d, [1] * 6, [1, 7, 8, 9, 130, 333], seed=hq * d)
    p = cpu_native.ptr
    outs = []
    for lib in libs:
        out = torch.zeros_like(q)
        rc = lib.epd_decode_attention(
            p(out),
            p(q),
            p(kc),
            p(vc),
            p(plan.tables),
            plan.tables.stride(0),
            p(plan.lens),
            p(plan.rows),
            p(plan.seqs),
            plan.num_rows,
            hq,
            hkv,
            d,
            16,
            d**-0.5,
        )
        assert rc == 0
        outs.append(out)
    assert outs[0].abs().sum() > 0 and torch.equal(outs[0], outs[1])


@pytest.mark.parametrize("hq,hkv,d", [(8, 4, 64), (14, 2, 64), (16, 2, 128), (8, 4, 80)])
def test_prefill_tiles_are_the_same_on_avx2(libs, hq, hkv, d):
    q, kc, vc, meta, plan = _inputs(hq, hkv, d, [37, 150, 3], [37, 300, 70], seed=hq + d)
    p = cpu_native.ptr
    outs = []
    for lib in libs:
        out = torch.zeros_like(q)
        rc = lib.epd_extend_attention(
            p(out),
            p(q),
            p(kc),
            p(vc),
            p(plan.tables),
            plan.tables.stride(0),
            p(plan.units),
            plan.units.shape[0],
            hq,
            hkv,
            d,
            16,
            d**-0.5,
        )
        assert rc == 0
        outs.append(out)
    assert outs[0].abs().sum() > 0 and torch.equal(outs[0], outs[1])
