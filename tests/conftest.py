"""Shared by every test: make the repository root importable, and put Triton in
interpreter mode on machines without CUDA before anything imports it (transformers and
torch._dynamo import triton early; kernels defined after that must already see
TRITON_INTERPRET=1)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
