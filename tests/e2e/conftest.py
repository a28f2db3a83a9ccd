"""Shared by the e2e tests: one demo checkpoint for every `epd up` they start."""

from __future__ import annotations

from pathlib import Path

import pytest

from services.models.demo import ensure_demo_model


@pytest.fixture(scope="session")
def demo_dir(tmp_path_factory) -> Path:
    """One demo checkpoint for every e2e test (generated once, before any server)."""
    root = tmp_path_factory.mktemp("demo")
    ensure_demo_model(root)
    return root
