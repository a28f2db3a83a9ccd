"""services.runtime.run: the event loop a service process runs on (ServiceConfig.event_loop)."""

from __future__ import annotations

import asyncio

import pytest

from services.config import ServiceConfig
from services.runtime import run


async def loop_module() -> str:
    await asyncio.sleep(0)
    return type(asyncio.get_running_loop()).__module__


def test_asyncio_runs_on_asyncios_own_loop():
    assert run(loop_module(), "asyncio").startswith("asyncio")


@pytest.mark.parametrize("choice", ["auto", "uvloop"])
def test_auto_and_uvloop_run_on_uvloop(choice):
    pytest.importorskip("uvloop")  # a dependency everywhere but Windows
    assert run(loop_module(), choice).startswith("uvloop")


def test_service_config_reads_the_loop_and_rejects_others(monkeypatch):
    monkeypatch.setenv("EPD_EVENT_LOOP", "asyncio")
    assert ServiceConfig.from_env().event_loop == "asyncio"
    with pytest.raises(ValueError, match="event_loop must be one of auto, uvloop, asyncio"):
        ServiceConfig(event_loop="trio")
