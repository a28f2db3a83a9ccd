"""Conditional disaggregation: TTFT of short text prompts prefilled on their decode
instance against the full prefill -> KV transfer -> decode path.

    python bench/local_prefill.py            # about 3 minutes
    python bench/local_prefill.py --quick    # about 1 minute

One fleet of processes (encoder, prefill, decode on the demo model) and two gateways on
it: ``split`` (always disaggregated) and ``local`` (``EPD_MAX_LOCAL_PREFILL_TOKENS``).
Each round sends one fresh text prompt per length to both gateways, one at a time,
alternating which goes first (unique words: the prefix cache never helps). TTFT is
request sent -> first token, on the client; max_tokens=8, greedy (outputs compared).
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from _latency_run import timed  # noqa: E402
from _latency_stats import pct  # noqa: E402
from _stack import HOST, Fleet  # noqa: E402

WORDS = {32: 6, 128: 30, 480: 118}  # words per prompt -> about that many prompt tokens


def request(round_id: int, words: int, system: str):
    from protos.epd_pb import inference_pb2 as pb

    # Words unique to the round and the system: a decode instance keeps the imported KV
    # of a split request in its prefix cache, so the same prompt sent to both systems
    # would favour whichever goes second.
    text = " ".join(f"{system}{round_id}w{j}" for j in range(words))
    msg = pb.ChatMessage(role="user", parts=[pb.ContentPart(text=text)])
    sp = pb.SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    return pb.GenerateRequest(model="demo", chat=pb.Chat(messages=[msg]), sampling=sp)


async def run(ports: dict[str, int], rounds: int, warmup: int) -> dict:
    import grpc

    from protos.epd_pb import inference_pb2_grpc as pbg

    channels = {k: grpc.aio.insecure_channel(f"{HOST}:{p}") for k, p in ports.items()}
    stubs = {k: pbg.InferenceStub(c) for k, c in channels.items()}
    ttft: dict[tuple[str, int], list[float]] = {}
    mismatches = 0
    try:
        for r in range(-warmup, rounds):
            order = list(stubs) if r % 2 == 0 else list(reversed(stubs))
            for length, words in WORDS.items():
                for name in order:
                    s = await timed(stubs[name], "text", request(r, words, name))
                    if r >= 0:
                        ttft.setdefault((name, length), []).append(s.ttft_s * 1e3)
                if r >= 0:  # the same prompt on both paths, for the comparison only
                    same = request(r, words, "same")
                    pair = [(await timed(stubs[n], "text", same)).tokens for n in stubs]
                    mismatches += pair[0] != pair[1]
    finally:
        for c in channels.values():
            await c.close()
    return {"ttft": ttft, "mismatches": mismatches}


def report(res: dict, rounds: int, limit: int) -> None:
    print(
        f"\nTTFT (ms), {rounds} rounds, one request at a time; local = prompts of at most "
        f"{limit} uncached tokens prefill on the decode instance"
    )
    print("| prompt tokens | split p50 | local p50 | saved p50 | split p90 | local p90 |")
    print("| ---: | ---: | ---: | ---: | ---: | ---: |")
    for length in WORDS:
        a, b = res["ttft"][("split", length)], res["ttft"][("local", length)]
        print(
            f"| ~{length} | {pct(a, 50):.1f} | {pct(b, 50):.1f} | "
            f"{pct(a, 50) - pct(b, 50):+.1f} | {pct(a, 90):.1f} | {pct(b, 90):.1f} |"
        )
    print(f"greedy outputs that differ between the two paths: {res['mismatches']}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--limit", type=int, default=512, help="max_local_prefill_tokens")
    args = ap.parse_args()
    rounds, warmup = (6, 2) if args.quick else (30, 4)
    started = time.perf_counter()
    fleet = Fleet()
    try:
        fleet.start_servers()
        for role in ("encoder", "prefill", "decode"):
            fleet.spawn(role, f"{role}-0")
        ports = {
            "split": fleet.spawn("gateway", "split", env={"EPD_MAX_LOCAL_PREFILL_TOKENS": "0"}),
            "local": fleet.spawn(
                "gateway", "local", env={"EPD_MAX_LOCAL_PREFILL_TOKENS": str(args.limit)}
            ),
        }
        for port in ports.values():
            fleet.wait_healthy(port, timeout_s=300)
        res = asyncio.run(run(ports, rounds, warmup))
        fleet.check_alive()
    finally:
        fleet.close()
    report(res, rounds, args.limit)
    print(f"total {time.perf_counter() - started:.0f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
