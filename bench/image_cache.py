"""Repeated images with a warm embedding cache against a cold one, through the fleet.

    python bench/image_cache.py            # ~5 minutes on 2 cores
    python bench/image_cache.py --quick

A Qwen2.5-VL checkpoint with the real vision tower's widths (hidden 1280, 16 heads, MLP
3420, 112-pixel windows; --depth blocks instead of 32, the last one full attention) and
a tiny decoder, so a tower pass costs what a real one costs per block. Encoder, prefill
and decode run as `epd serve` processes on private NATS and Redis. `epd bench serve
--dataset random-mm` sends the same seeded requests twice: the first run meets a cold
embedding cache (every image is new), the second a warm one (every image is a repeat).
The response cache is bypassed and the prefill's prefix cache is off, so the second
run's only saving is the tower pass the embedding cache skips.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from _stack import Fleet  # noqa: E402

from tests.helpers.checkpoints import make_qwen2_5_vl_checkpoint  # noqa: E402


def real_width_tower(depth: int) -> dict:
    """Qwen2.5-VL-7B's vision tower widths with ``depth`` blocks."""
    return dict(
        depth=depth,
        hidden_size=1280,
        intermediate_size=3420,
        num_heads=16,
        window_size=112,
        fullatt_block_indexes=[depth - 1],
    )


def bench_serve(port: int, out: Path, args) -> dict:
    cmd = [
        sys.executable,
        "-m",
        "launch.cli",
        "bench",
        "serve",
        "--base-url",
        f"http://127.0.0.1:{port}/v1",
        "--dataset",
        "random-mm",
        "--num-prompts",
        str(args.prompts),
        "--max-concurrency",
        "1",
        "--random-input-len",
        "32",
        "--random-output-len",
        "8",
        "--mm-image-size",
        args.size,
        "--seed",
        "7",
        "--header",
        "x-epd-cache:bypass",
        "--no-progress",
        "--result-json",
        str(out),
    ]
    subprocess.run(cmd, check=True, cwd=ROOT, stdout=subprocess.DEVNULL)
    return json.loads(out.read_text())["summary"]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="fewer requests, 2 tower blocks")
    ap.add_argument("--depth", type=int, default=4)
    ap.add_argument("--size", default="448x448", help="the images' size (448x448)")
    args = ap.parse_args()
    args.prompts = 6 if args.quick else 16
    depth = 2 if args.quick else args.depth
    root = Path(tempfile.mkdtemp(prefix="epd-image-cache-"))
    ckpt = make_qwen2_5_vl_checkpoint(root, max_pixels=1280 * 1280, vision=real_width_tower(depth))
    fleet = Fleet(model=str(ckpt))
    env = {"EPD_ENABLE_PREFIX_CACHING": "0", "EPD_NUM_KV_BLOCKS": "1024"}
    try:
        fleet.start_servers()
        for role in ("encoder", "prefill", "decode"):
            fleet.spawn(role, f"{role}-0", log_level="WARNING", env=env)
        port = fleet.spawn("gateway", "gateway-0", log_level="WARNING", env=env)
        fleet.wait_healthy(port, timeout_s=300)
        http = fleet.http_ports["gateway-0"]
        cold = bench_serve(http, root / "cold.json", args)
        warm = bench_serve(http, root / "warm.json", args)
        fleet.check_alive()
    finally:
        fleet.close()
    print(
        f"Qwen2.5-VL tower at real widths, {depth} blocks; {args.prompts} requests, "
        f"one {args.size} image each, one at a time (epd bench serve --dataset random-mm)"
    )
    print(f"{'embedding cache':<16} {'TTFT p50':>9} {'TTFT p90':>9} {'req/s':>7}")
    for name, doc in (("cold", cold), ("warm", warm)):
        assert doc["failed"] == 0, doc["errors"]
        t = doc["ttft_ms"]
        print(f"{name:<16} {t['p50']:8.1f}ms {t['p90']:8.1f}ms {doc['request_throughput']:7.2f}")
    ratio = cold["ttft_ms"]["p50"] / warm["ttft_ms"]["p50"]
    print(f"warm TTFT p50 is {ratio:.1f}x faster than cold (goal >= 3x)")
    return 0 if ratio >= 3.0 else 1


if __name__ == "__main__":
    sys.exit(main())
