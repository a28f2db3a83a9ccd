"""A fleet gateway's start-up time and memory: `epd serve gateway` (demo model) as a
process against a private NATS and Redis, from spawn until REST `/health` answers (503:
up, no workers yet), then its resident memory; best and median of --rounds.

    python bench/gateway_startup.py [--rounds 5] [--checkout DIR ...]

--checkout (repeatable) runs the gateway of other checkouts with this venv (e.g. a `git
worktree` of an older commit), rounds interleaved, for a before/after comparison:

    git worktree add /tmp/gw-before 156c1f3   # the last commit whose gateway imported torch
    python bench/gateway_startup.py --checkout . --checkout /tmp/gw-before
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from launch.localstack import free_port, start_nats, start_redis  # noqa: E402


def _rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def one(checkout: Path, nats_url: str, redis_url: str) -> tuple[float, float]:
    port = free_port("127.0.0.1")
    argv = [
        sys.executable,
        "-m",
        "launch.cli",
        "--log-level",
        "WARNING",
        "serve",
        "gateway",
        "--nats-url",
        nats_url,
        "--redis-url",
        redis_url,
        "--http-port",
        str(port),
        "--grpc-port",
        str(free_port("127.0.0.1")),
    ]
    env = {**os.environ, "PYTHONPATH": str(checkout)}
    t0 = time.perf_counter()
    proc = subprocess.Popen(
        argv, cwd=checkout, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE
    )
    try:
        while True:
            if proc.poll() is not None:
                raise RuntimeError(proc.stderr.read().decode(errors="replace")[-2000:])
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1)
                break
            except urllib.error.HTTPError:  # 503: serving, no workers
                break
            except OSError:
                time.sleep(0.02)
        started = time.perf_counter() - t0
        time.sleep(0.5)  # let start-up work in the background settle
        return started, _rss_mb(proc.pid)
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--checkout", type=Path, action="append")
    args = ap.parse_args()
    from services.config import EngineConfig
    from services.models.demo import ensure_demo_model

    ensure_demo_model(EngineConfig.from_env().demo_dir)  # generated once, outside the timing
    checkouts = [c.resolve() for c in args.checkout or [ROOT]]
    runs = {c: [] for c in checkouts}
    with start_nats(host="127.0.0.1") as nats, start_redis(host="127.0.0.1") as redis:
        for _ in range(args.rounds):
            for c in checkouts:
                runs[c].append(one(c, nats.url, redis.url))
    for c, rounds in runs.items():
        times, rss = [r[0] for r in rounds], [r[1] for r in rounds]
        print(
            f"gateway of {c}: start-up to /health best {min(times):.2f} s, median "
            f"{statistics.median(times):.2f} s; RSS median {statistics.median(rss):.0f} MB "
            f"({args.rounds} rounds)"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
