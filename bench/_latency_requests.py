"""Benchmark helper: the chat request workload for the latency comparison.

Half the requests are text-only and half carry one new 64x64 PNG, unique per round, so
neither the embedding cache nor the prefix cache helps.
"""

from __future__ import annotations

import io
import random
import zlib

MAX_TOKENS = 32


def png(seed: int) -> bytes:
    from PIL import Image

    rng = random.Random(seed)
    img = Image.frombytes("RGB", (64, 64), rng.randbytes(64 * 64 * 3))
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return buf.getvalue()


def request(tag: str, image: bytes | None):
    from protos.epd_pb import inference_pb2 as pb

    words = "please describe what you see here in careful detail and then list every color"
    text = f"request {tag}: {words}, {words}."
    parts = ([pb.ContentPart(image=image)] if image else []) + [pb.ContentPart(text=text)]
    sp = pb.SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    return pb.GenerateRequest(
        model="demo", sampling=sp, chat=pb.Chat(messages=[pb.ChatMessage(role="user", parts=parts)])
    )


def request_set(round_id: str, n: int) -> list[tuple[str, object]]:
    """(kind, request) pairs, alternating text and 1-image; unique per round."""
    out = []
    for i in range(n):
        kind = "image" if i % 2 else "text"
        image = png(zlib.crc32(f"{round_id}-{i}".encode())) if kind == "image" else None
        out.append((kind, request(f"{round_id}-{i}", image)))
    return out
