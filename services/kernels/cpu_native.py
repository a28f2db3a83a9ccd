"""Build and load the native CPU kernels (``csrc/*.c``) through ctypes.

Why C and not more torch: the decode hot path on CPU is dominated by ops torch cannot
fuse (a paged gather followed by SDPA reads the KV cache three times; a GEMV through MKL
reads weights at ~60 % of memory bandwidth). The library is compiled on first use with
the system C compiler (``EngineConfig.kernel_cc``) into a cache directory keyed by the source,
the flags and the CPU, so a fresh machine needs only a compiler; without one the torch
backend serves (``load`` returns None and says why).
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

log = logging.getLogger(__name__)

CSRC = Path(__file__).with_name("csrc")
_UNITS = (
    "cpu",
    "gemv_rows",
    "quant",
    "attention",
    "kvq8",
    "extend",
    "team",
    "decode",
    "head",
    "parallel",
)
SOURCES = [CSRC / f"epd_{name}.c" for name in _UNITS]
HEADERS = [CSRC / "epd_common.h", CSRC / "epd_team.h"]
# -fno-trapping-math: GCC then if-converts the float clamps of exp_approx, so the exp loops
# (softmax, SiLU) vectorize (SiLU·mul was ~10x slower scalar); values are unchanged (no
# kernel reads FP exception flags).
FLAGS = ["-O3", "-march=native", "-fPIC", "-shared", "-std=c11", "-fno-trapping-math"]
# -fopenmp: the layer path's kernels run on torch's own OpenMP team (epd_parallel.c). A
# compiler without OpenMP builds the library without it (those kernels on one thread).
OPENMP = ["-fopenmp"]

_P, _I64, _F = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float
_SIGNATURES = {
    "epd_decode_attention": (
        ctypes.c_int,
        [_P, _P, _P, _P, _P, _I64, _P, _P, _P, _I64, _I64, _I64, _I64, _I64, _F],
    ),
    "epd_extend_attention": (
        ctypes.c_int,
        [_P, _P, _P, _P, _P, _I64, _P, _I64, _I64, _I64, _I64, _I64, _F],
    ),
    "epd_decode_stack": (
        ctypes.c_int,
        [_P, _P, _P, _I64, _P, _P, _P, _P, _P, _P, _P, _P, _P, _F, _F, _P, _P, _I64, _I64],
    ),
    "epd_decode_scratch": (_I64, [_P, _I64]),
    "epd_decode_greedy": (
        ctypes.c_int,
        [
            _P,
            _P,
            _P,
            _P,
            ctypes.c_int,
            _I64,
            _I64,
            _P,
            _P,
            _P,
            _P,
            _P,
            _P,
            _P,
            _F,
            _F,
            _P,
            _P,
            _I64,
            _I64,
        ],
    ),
    "epd_decode_greedy_scratch": (_I64, [_P, _I64, _I64]),
    "epd_gemv_t": (None, [_P, _I64, _P, _P, _I64, _P, _I64, _I64, _I64]),
    "epd_gemv_rows": (ctypes.c_int, [_P, _I64, _P, _P, _I64, _P, _I64, _I64, _I64]),
    "epd_silu_mul": (None, [_P, _P, _I64, _I64]),
    "epd_rms_norm": (None, [_P, _P, _P, _P, _P, _I64, _I64, _F]),
    "epd_argmax": (None, [_P, _P, _I64, _I64]),
    "epd_gemv_rm": (None, [_P, _I64, _P, _P, _I64, _P, _I64, _I64, _I64]),
    "epd_gemv_argmax": (ctypes.c_int, [_P, _P, _P, _I64, _I64, _I64, ctypes.c_int]),
    "epd_rotary": (None, [_P, _P, _P, _P, _I64, _I64, _I64, _I64, _I64, ctypes.c_int]),
    "epd_openmp": (ctypes.c_int, []),
    "epd_par_decode_attention": (
        ctypes.c_int,
        [_P, _P, _P, _P, _P, _I64, _P, _P, _P, _I64, _I64, _I64, _I64, _F, _P, _I64],
    ),
    "epd_par_decode_attention_q8": (
        ctypes.c_int,
        [_P, _P, _P, _P, _P, _I64, _P, _P, _P, _I64, _I64, _I64, _I64, _F, ctypes.c_int, _P, _I64],
    ),
    "epd_kv_quantize": (None, [_P, _P, _I64, _I64, ctypes.c_int]),
    "epd_par_extend_attention": (
        ctypes.c_int,
        [_P, _P, _P, _P, _P, _I64, _P, _I64, _I64, _I64, _I64, _F, _P, _I64],
    ),
    "epd_par_gemv": (None, [_P, _P, _P, _P, _I64, _I64, _I64, ctypes.c_int, _P, _I64]),
    "epd_group_sums": (None, [_P, _P, _I64, _I64, _I64, _I64]),
    "epd_par_qgemv_i8": (None, [_P, _P, _I64, _I64, _I64, _P, _P, _P, _P, _I64]),
    "epd_par_qgemv_i4": (
        None,
        [_P, _P, _P, _I64, _I64, _I64, _I64, _P, _P, _P, _I64, _P, _P, _I64],
    ),
    "epd_par_silu_mul": (None, [_P, _P, _I64, _P, _I64]),
    "epd_par_rms_norm": (None, [_P, _P, _P, _P, _P, _I64, _F, _P, _I64]),
    "epd_par_rotary": (None, [_P, _P, _P, _P, _I64, _I64, _I64, _I64, ctypes.c_int, _P, _I64]),
    "epd_par_argmax": (None, [_P, _P, _I64, _P, _I64]),
    "epd_screen_argmax": (
        _I64,
        [_P, _P, _P, _P, _P, _P, _P, _P, _I64, _I64, _I64, ctypes.c_int, _I64],
    ),
    "epd_par_gemv_bf16": (ctypes.c_int, [_P, _P, _P, _I64, _I64, _I64, _P, _I64]),
    "epd_par_screen_argmax": (
        _I64,
        [_P, _P, _P, _P, _P, _P, _P, _P, _I64, _I64, ctypes.c_int, _I64, _P, _I64],
    ),
    "epd_par_decode_stack": (
        None,
        [_P, _P, _P, _I64, _P, _P, _P, _P, _P, _P, _P, _P, _P, _F, _F, _P, _P, _I64, _P],
    ),
    "epd_par_decode_greedy": (
        None,
        [
            _P,
            _P,
            _P,
            _P,
            ctypes.c_int,
            _I64,
            _I64,
            _P,
            _P,
            _P,
            _P,
            _P,
            _P,
            _P,
            _F,
            _F,
            _P,
            _P,
            _I64,
            _P,
        ],
    ),
}

_loaded: dict[str, ctypes.CDLL | None] = {}


def ptr(t: torch.Tensor | None, offset: int = 0) -> int | None:
    """Address of element ``offset`` of t (None for None), as the kernels take it."""
    return None if t is None else t.data_ptr() + offset * t.element_size()


def bounds(ranges: list[tuple[int, int]]) -> tuple[ctypes.Array, int]:
    """Contiguous ranges as the epd_par_* kernels take them: [lo_0, lo_1, ..., hi_last], count."""
    flat = [lo for lo, _ in ranges] + [ranges[-1][1] if ranges else 0]
    return (ctypes.c_int64 * len(flat))(*flat), len(ranges)


def fp32(*ts: torch.Tensor) -> bool:
    """Every tensor fp32, on CPU and contiguous: what the kernels read."""
    # A loop, not all(<genexpr>): this runs ~100 times per decode step.
    for t in ts:
        if t.dtype is not torch.float32 or not t.is_cpu or not t.is_contiguous():
            return False
    return True


def gemv_layout(weight: torch.Tensor) -> int | None:
    """How the GEMV kernels read a weight W [n, k]: 1 = W^T contiguous (the column-major
    weights models keep on CPU), 0 = W row-major (nn.Linear's own, e.g. a tied LM head),
    None = neither, or not fp32 on CPU (torch's op serves)."""
    if weight.dtype is not torch.float32 or weight.device.type != "cpu" or weight.dim() != 2:
        return None
    n, k = weight.shape
    if weight.stride() == (1, n):
        return 1
    return 0 if weight.stride() == (k, 1) else None


def default_cache_dir() -> str:
    return os.path.expanduser("~/.cache/epd-serve/kernels")


def _cpu_id() -> str:
    """What -march=native depends on: the CPU model and its feature flags."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return platform.processor()
    keep = [ln for ln in lines if ln.startswith(("model name", "flags"))][:2]
    return "\n".join(keep)


def _library_path(cache_dir: Path, compiler: str) -> Path:
    h = hashlib.sha256()
    parts = [p.read_bytes() for p in SOURCES + HEADERS]
    parts += [
        " ".join(FLAGS + OPENMP).encode(),
        compiler.encode(),
        _cpu_id().encode(),
        platform.machine().encode(),
    ]
    for part in parts:
        h.update(part)
        h.update(b"\0")
    return cache_dir / f"epd_cpu-{h.hexdigest()[:16]}.so"


def _build(target: Path, compiler: str) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    # Build beside the target and rename: concurrent processes never see half a library.
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    try:
        for extra in (OPENMP, []):
            cmd = [compiler, *FLAGS, *extra, "-o", tmp, *map(str, SOURCES), "-lm"]
            res = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
            if res.returncode == 0:
                break
            if extra:
                log.warning("native CPU kernels built without OpenMP: %s", res.stderr.strip()[:300])
        if res.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} failed: {res.stderr.strip()[:500]}")
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


# glibc mallopt parameters
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3
_MMAP_THRESHOLD_MAX = 32 << 20  # glibc's ceiling on 64-bit


def keep_freed_memory() -> bool:
    """Make glibc keep freed memory in the heap instead of returning it to the OS.

    A CPU engine step allocates and frees the same large activations (tens of MB) again
    and again; by default each one is a fresh mmap, zero-filled page by page on first
    touch: ~100k page faults and ~0.4 s of kernel time per W1 run, 4 % of it. The cost is
    that the heap keeps its peak size, which recurs every step anyway. False where the C
    library is not glibc (nothing changed).
    """
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return False
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return False
    ok = libc.mallopt(_M_MMAP_THRESHOLD, _MMAP_THRESHOLD_MAX)
    ok &= libc.mallopt(_M_TRIM_THRESHOLD, 1 << 30)
    return bool(ok)


def return_freed_memory() -> None:
    """Hand the heap's free memory back to the OS once (glibc's malloc_trim): after a
    model's full-precision weights are replaced by quantized ones, which
    ``keep_freed_memory`` would otherwise keep in the heap for good."""
    if platform.system() == "Linux" and platform.libc_ver()[0] == "glibc":
        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL("libc.so.6").malloc_trim(0)


def load(cache_dir: str | os.PathLike, compiler: str = "cc") -> ctypes.CDLL | None:
    """The kernel library (built if needed), or None when it cannot be built here."""
    key = f"{cache_dir}|{compiler}"
    if key in _loaded:
        return _loaded[key]
    lib = None
    cc = shutil.which(compiler)
    if cc is None:
        log.warning(
            "no C compiler %r found: native CPU kernels off, using the torch backend", compiler
        )
    elif platform.machine() not in ("x86_64", "AMD64", "aarch64", "arm64"):
        log.warning(
            "native CPU kernels untested on %s: using the torch backend", platform.machine()
        )
    else:
        try:
            path = _library_path(Path(cache_dir), cc)
            if not path.exists():
                _build(path, cc)
            lib = ctypes.CDLL(str(path))
            for name, (res, args) in _SIGNATURES.items():
                fn = getattr(lib, name)
                fn.restype, fn.argtypes = res, args
        except (OSError, RuntimeError, subprocess.SubprocessError) as e:
            log.warning("native CPU kernels unavailable (%s): using the torch backend", e)
            lib = None
    _loaded[key] = lib
    return lib
