"""Tiny checkpoints shared by the engine unit tests (built once per session)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.helpers.checkpoints import make_llava_checkpoint, make_text_checkpoint


@pytest.fixture(scope="session")
def tiny_root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("tiny-ckpts")


@pytest.fixture(scope="session")
def llama_ckpt(tiny_root) -> Path:
    return make_text_checkpoint(tiny_root, "llama")


@pytest.fixture(scope="session")
def llava_ckpt(tiny_root) -> Path:
    return make_llava_checkpoint(tiny_root)
