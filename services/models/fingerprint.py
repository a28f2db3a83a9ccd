"""A checkpoint's fingerprint: what every service and gateway agree a model is.

It names the model on the bus (``epd.encoder.<fp>.<id>``, heartbeats) and keys the caches
(``epd:emb:<fp>:<image>``, the semantic cache), so two checkpoints of one shape with
different weights (two fine-tunes) must differ, and one checkpoint copied to another
host or folder must not. The weights' content is covered without reading all of it:
per safetensors file, its header (every tensor's name, dtype, shape and offsets), a
few bytes of every tensor (head, middle, tail) and evenly spaced blocks of the data.
A file's digest is computed once and kept in a small cache keyed by its path, size
and modification time.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import struct
from pathlib import Path

from services.models.checkpoint import CheckpointError

log = logging.getLogger(__name__)

# Bytes read at the head, middle and tail of every tensor.
_TENSOR_SAMPLE = 256
# Evenly spaced blocks of each file's data region, and their size.
_BLOCKS = 64
_BLOCK_BYTES = 4096
# Bump when the digest changes meaning: old cache entries are then ignored.
_VERSION = "v1"
_JSON_FILES = ("config.json", "preprocessor_config.json", "processor_config.json")


def default_cache_dir() -> Path:
    """Where file digests are kept: ~/.cache/epd-serve/fingerprints."""
    return Path.home() / ".cache" / "epd-serve" / "fingerprints"


def checkpoint_fingerprint(model_dir: Path, extra: str = "", cache_dir: Path | None = None) -> str:
    """16 hex digits over the checkpoint's JSON configs and the content digests of its
    safetensors files (by file name, not path); ``extra``: what else changes the
    model (load format, dummy seed)."""
    h = hashlib.sha256(_VERSION.encode())
    for name in _JSON_FILES:
        if (model_dir / name).exists():
            h.update(name.encode() + b"\0" + (model_dir / name).read_bytes())
    for f in sorted(model_dir.glob("*.safetensors")):
        h.update(f"{f.name}:{file_digest(f, cache_dir)}".encode())
    h.update(extra.encode())
    return h.hexdigest()[:16]


def file_digest(path: Path, cache_dir: Path | None = None) -> str:
    """The content digest of one safetensors file, from the cache when its path, size
    and modification time are unchanged."""
    cache_dir = cache_dir or default_cache_dir()
    st = path.stat()
    key = hashlib.sha256(
        f"{_VERSION}:{path.resolve()}:{st.st_size}:{st.st_mtime_ns}".encode()
    ).hexdigest()
    entry = cache_dir / key
    try:
        return entry.read_text().strip()
    except OSError:
        pass
    try:
        digest = _sampled_digest(path, st.st_size)
    except (ValueError, KeyError, TypeError, struct.error) as e:  # json errors are ValueErrors
        raise CheckpointError(f"cannot read weights from {path.name}: {e}") from e
    try:
        cache_dir.mkdir(parents=True, exist_ok=True)
        tmp = entry.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(digest)
        tmp.replace(entry)  # atomic: concurrent services never read half an entry
    except OSError as e:  # a read-only home costs a recomputation next time, nothing more
        log.debug("fingerprint cache not written (%s): %s", entry, e)
    return digest


def _sampled_digest(path: Path, size: int) -> str:
    """sha256 over the file's size, its header, samples of every tensor and evenly
    spaced blocks of the data."""
    h = hashlib.sha256(str(size).encode())
    with path.open("rb") as f:
        (header_len,) = struct.unpack("<Q", _read(f, 0, 8, exact=True))
        if header_len > size - 8:
            raise ValueError(f"{path}: not a safetensors file (header of {header_len} bytes)")
        header = _read(f, 8, header_len, exact=True)
        h.update(header)
        start = 8 + header_len
        for offset, length in _tensor_spans(header):
            for at in (0, max(0, length // 2 - _TENSOR_SAMPLE // 2), length - _TENSOR_SAMPLE):
                at = max(0, at)
                h.update(_read(f, start + offset + at, min(_TENSOR_SAMPLE, length - at)))
        data = size - start
        step = max(_BLOCK_BYTES, data // _BLOCKS)
        for at in range(start, size, step):
            h.update(_read(f, at, min(_BLOCK_BYTES, size - at)))
    return h.hexdigest()


def _tensor_spans(header: bytes) -> list[tuple[int, int]]:
    """(data offset, byte length) of every tensor, in name order."""
    meta = json.loads(header)
    spans = []
    for name in sorted(meta):
        if name == "__metadata__":
            continue
        begin, end = meta[name]["data_offsets"]
        spans.append((int(begin), int(end) - int(begin)))
    return spans


def _read(f, offset: int, length: int, exact: bool = False) -> bytes:
    f.seek(offset)
    data = f.read(max(0, length))
    if exact and len(data) != length:
        raise ValueError(f"truncated file: wanted {length} bytes at {offset}")
    return data
