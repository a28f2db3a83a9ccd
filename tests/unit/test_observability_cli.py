"""The CLI documents itself and the log formats keep their promises: every option of
`epd serve` and `epd up` has a help text, the help lists every EPD_* variable of every
config class; a JSON log line has its fields and the request id of its context; URL
passwords are masked in both formats; bad observability settings fail at construction."""

from __future__ import annotations

import asyncio
import dataclasses
import io
import json
import logging

import pytest

from cache_svc.config import SemanticCacheConfig
from gateway.config import GatewayConfig
from launch.cli import build_parser
from services.config import EngineConfig, ServiceConfig
from services.metrics import subject_kind
from services.observability import (
    ObservabilityConfig,
    bind_request,
    identity,
    make_handler,
    set_process_identity,
)

CONFIGS = (EngineConfig, ServiceConfig, GatewayConfig, SemanticCacheConfig, ObservabilityConfig)


def _subparser(name: str):
    sub = next(a for a in build_parser()._actions if a.dest == "command")
    return sub.choices[name]


@pytest.mark.parametrize("command", ["serve", "up"])
def test_every_option_has_help_and_every_variable_is_listed(command):
    parser = _subparser(command)
    undocumented = [a.option_strings or a.dest for a in parser._actions if not a.help]
    assert undocumented == []
    text = parser.format_help()
    for cls in CONFIGS:
        for f in dataclasses.fields(cls):
            assert f"EPD_{f.name.upper()}" in text, f.name


def _capture(fmt: str) -> tuple[logging.Logger, io.StringIO]:
    # A CLI run in this process (another test's `epd health`) names the process's lines.
    set_process_identity("", "")
    buf = io.StringIO()
    logger = logging.getLogger(f"test.observability.{fmt}")
    logger.handlers[:] = [make_handler(ObservabilityConfig(log_format=fmt), stream=buf)]
    logger.propagate, logger.level = False, logging.INFO
    return logger, buf


def test_json_line_carries_service_instance_and_the_request_id_of_its_task():
    logger, buf = _capture("json")

    async def handler(rid: str) -> None:
        bind_request(rid)
        await asyncio.sleep(0)  # another handler runs here: its id must not leak
        logger.info("working on it")

    async def main() -> None:
        with identity("prefill", "prefill-7"):
            await asyncio.gather(handler("req-a"), handler("req-b"))
        logger.info("outside")

    asyncio.run(main())
    lines = [json.loads(line) for line in buf.getvalue().splitlines()]
    assert [(ln["service"], ln["instance"], ln["request_id"]) for ln in lines] == [
        ("prefill", "prefill-7", "req-a"),
        ("prefill", "prefill-7", "req-b"),
        ("", "", ""),
    ]
    assert lines[0]["level"] == "INFO" and lines[0]["logger"] == logger.name
    assert lines[0]["message"] == "working on it" and lines[0]["time"].endswith("+00:00")


@pytest.mark.parametrize("fmt", ["text", "json"])
def test_passwords_are_masked_in_every_format(fmt):
    logger, buf = _capture(fmt)
    logger.info(
        "connecting to %s and %s",
        "nats://bob:hunter2@h:4222",
        "redis://:pa55word@r:6379/0?sentinel_password=s3nt",
    )
    try:
        raise ValueError("failed: rediss://:pa55word@r:6380")
    except ValueError:
        logger.exception("boom")
    out = buf.getvalue()
    assert "hunter2" not in out and "pa55word" not in out and "s3nt" not in out
    assert "nats://bob:***@h:4222" in out


def test_bad_settings_fail_at_construction():
    with pytest.raises(ValueError, match="log_format"):
        ObservabilityConfig(log_format="xml")
    with pytest.raises(ValueError, match="metrics_port"):
        ObservabilityConfig(metrics_port=70000)
    assert ObservabilityConfig(log_level="debug").log_level == "DEBUG"


def test_bus_metric_labels_keep_instance_ids_out():
    assert subject_kind("epd.prefill.prefill-3f2a") == "epd.prefill"
    assert subject_kind("epd.cache.lookup") == "epd.cache"
    assert subject_kind("epd") == "epd"
