"""GPU check of every Triton kernel: correctness against its torch twin, then timings.

    python bench/kernels_gpu.py [--budget 270]

Real sizes (32 query heads, 8 kv heads, head_dim 128, bf16, contexts 512 to 32k, batch
1 to 256). Each section prints ``PASS``/``FAIL``/``SKIP`` lines and its timings
(``triton.testing.do_bench`` medians); decode attention's bandwidth is reported as a
fraction of a device-to-device copy measured in the same run (goal >= 70 %). Sections
past ``--budget`` seconds are skipped, and a hard watchdog ends the run 60 s later.
Exit status 1 when any correctness check failed. Needs CUDA; flash_attn is optional.
"""

from __future__ import annotations

import argparse
import faulthandler
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from anywhere
from _gpu_attention import (  # noqa: E402
    HAS_FLASH_ATTN,
    section_decode_correctness,
    section_decode_speed,
    section_extend,
)
from _gpu_harness import Run, copy_bandwidth  # noqa: E402
from _gpu_ops import section_elementwise  # noqa: E402
from _gpu_sampling import section_sampling  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--budget", type=float, default=270.0, help="seconds before sections are skipped"
    )
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("SKIP all: no CUDA device")
        return 0
    faulthandler.dump_traceback_later(args.budget + 60, exit=True)  # hard watchdog
    run = Run(args.budget)
    print(
        f"device: {torch.cuda.get_device_name()}, flash_attn: {HAS_FLASH_ATTN}",
        flush=True,
    )
    copy_bw = copy_bandwidth()
    print(f"  device-to-device copy: {copy_bw / 1e9:.0f} GB/s", flush=True)
    for section in (
        section_elementwise,
        section_decode_correctness,
        section_extend,
        section_sampling,
    ):
        if run.time_left(section.__name__):
            run.check(section.__name__, lambda section=section: section(run))
    if run.time_left("decode timing"):
        section_decode_speed(run, copy_bw)
    print(
        f"{'FAIL' if run.failed else 'PASS'} overall in {time.monotonic() - run.start:.0f}s; failed: {run.failed}"
    )
    return 1 if run.failed else 0


if __name__ == "__main__":
    sys.exit(main())
