"""Tiny checkpoints shared by the engine unit tests (built once per session)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from services.kernels.cpu_backend import CpuBackend
from tests.helpers.checkpoints import make_llava_checkpoint, make_text_checkpoint
from tests.helpers.threads import set_threads


@pytest.fixture(scope="session")
def tiny_root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("tiny-ckpts")


@pytest.fixture(scope="session")
def llama_ckpt(tiny_root) -> Path:
    return make_text_checkpoint(tiny_root, "llama")


@pytest.fixture(scope="session")
def llava_ckpt(tiny_root) -> Path:
    return make_llava_checkpoint(tiny_root)


# Torch's thread count (the cpu backend's whole-step team is capped at the CPUs this
# process may use). Modules that want other counts make their own from set_threads.
threads = pytest.fixture(params=[1, 2, 3], ids=["1-thread", "2-threads", "3-threads"])(set_threads)


@pytest.fixture
def one_thread():
    """One torch thread for the test (the cpu backend then runs whole decode steps
    natively)."""
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)


@pytest.fixture(scope="module")
def be(tmp_path_factory) -> CpuBackend:
    """The cpu backend with its native kernels built (a module's own build directory)."""
    backend = CpuBackend.create(str(tmp_path_factory.mktemp("kernels")))
    assert backend is not None, "the native CPU kernels did not build (is a C compiler installed?)"
    return backend
