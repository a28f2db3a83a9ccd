"""One declaration per setting: docs/configuration.md is generated from the config
classes and must be current; every field is declared with ``setting`` (a docstring, no
default repeated anywhere else); flags, variables and values read back as declared."""

from __future__ import annotations

import dataclasses

import pytest

from launch.cli import build_parser, engine_config, gateway_config
from launch.cli_args import config_classes
from launch.config_docs import DOC, render
from services.config import EngineConfig, ServiceConfig
from services.settings import parse_text


def test_the_generated_doc_is_current():
    assert DOC.read_text() == render(), "stale: run `python -m launch.config_docs`"


@pytest.mark.parametrize("cls", [cls for _, cls in config_classes()], ids=lambda c: c.__name__)
def test_every_field_is_declared_with_a_docstring(cls):
    for f in dataclasses.fields(cls):
        assert f.metadata.get("doc", "").strip(), f"{cls.__name__}.{f.name} has no doc"


@pytest.mark.parametrize("cls", [cls for _, cls in config_classes()], ids=lambda c: c.__name__)
def test_a_config_survives_its_own_variables(cls):
    config = cls()
    assert cls(**cls.env_values(config.as_env())) == config


def test_text_is_read_by_the_declared_type():
    assert parse_text("a, b,,c", tuple[str, ...]) == ("a", "b", "c")
    assert parse_text("none", int | None) is None
    assert parse_text("7", int | None) == 7
    assert parse_text("Yes", bool) is True
    with pytest.raises(ValueError, match="expected one of"):
        parse_text("ture", bool)  # a typo must not read as False


def test_bounds_and_choices_fail_at_construction_naming_the_field():
    with pytest.raises(ValueError, match="max_num_seqs must be >= 1"):
        EngineConfig(max_num_seqs=0)
    with pytest.raises(ValueError, match="grpc_port must be in 0..65535"):
        ServiceConfig(grpc_port=70000)
    with pytest.raises(ValueError, match="dtype must be one of"):
        EngineConfig(dtype="int3")


def test_flags_win_over_variables_over_defaults(monkeypatch):
    monkeypatch.setenv("EPD_MAX_NUM_SEQS", "8")
    monkeypatch.setenv("EPD_BLOCK_SIZE", "32")
    args = build_parser().parse_args(["serve", "all", "--max-num-seqs", "4"])
    config = engine_config(args)
    assert (config.max_num_seqs, config.block_size, config.max_model_len) == (4, 32, None)


def test_list_flags_repeat_and_model_fills_both_settings(monkeypatch):
    monkeypatch.delenv("EPD_MODEL", raising=False)
    argv = [
        "serve",
        "gateway",
        "--model",
        "a",
        "--model",
        "b",
        "--api-key",
        "k1",
        "--api-key",
        "k2",
    ]
    args = build_parser().parse_args(argv)
    gateway = gateway_config(args)
    assert gateway.models == ("a", "b") and gateway.api_key == ("k1", "k2")
    assert engine_config(args).model == "a"
    assert "k1" not in repr(gateway)  # secrets stay out of logs


def test_generate_seed_is_the_requests_not_the_engines(monkeypatch):
    monkeypatch.delenv("EPD_SEED", raising=False)
    args = build_parser().parse_args(["generate", "hi", "--seed", "5"])
    assert args.request_seed == 5 and engine_config(args).seed == 0
