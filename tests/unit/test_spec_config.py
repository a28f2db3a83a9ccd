"""SpeculativeConfig: parsed from dicts and JSON, bad values refused at construction."""

from __future__ import annotations

import json

import pytest

from services.config import EngineConfig
from services.engine.spec.config import SpeculativeConfig


def test_parse_dict_json_and_env(tmp_path, monkeypatch) -> None:
    raw = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 5}
    a = EngineConfig(speculative_config=raw).speculative_config
    b = EngineConfig(speculative_config=json.dumps(raw)).speculative_config
    assert (
        a == b == SpeculativeConfig(method="ngram", num_speculative_tokens=3, prompt_lookup_max=5)
    )
    assert SpeculativeConfig.parse(a.to_json()) == a
    monkeypatch.setenv("EPD_SPECULATIVE_CONFIG", json.dumps(raw))
    assert EngineConfig.from_env().speculative_config == a
    assert EngineConfig().speculative_config is None
    assert EngineConfig(speculative_config="").speculative_config is None


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        ({"method": "medusa", "num_speculative_tokens": 3}, "method must be one of"),
        ({"method": "ngram", "num_speculative_tokens": 0}, "1..16"),
        ({"method": "ngram", "num_speculative_tokens": 17}, "1..16"),
        ({"method": "ngram", "num_speculative_tokens": 2.5}, "1..16"),
        (
            {
                "method": "ngram",
                "num_speculative_tokens": 3,
                "prompt_lookup_min": 4,
                "prompt_lookup_max": 2,
            },
            "prompt_lookup_min <= prompt_lookup_max",
        ),
        ({"method": "ngram"}, "needs 'method' and 'num_speculative_tokens'"),
        ({"method": "ngram", "num_speculative_tokens": 3, "k": 1}, "unknown speculative"),
        ({"method": "ngram", "num_speculative_tokens": 3, "model": "x"}, "eagle3' only"),
        ({"method": "eagle3", "num_speculative_tokens": 3}, "needs 'model'"),
        (
            {"method": "eagle3", "num_speculative_tokens": 3, "model": "/no/such/head"},
            "no config.json",
        ),
        ("{not json", "not valid JSON"),
        ("[1, 2]", "must be a JSON object"),
    ],
)
def test_bad_config_is_refused(raw, message) -> None:
    with pytest.raises(ValueError, match=message):
        EngineConfig(speculative_config=raw)


def test_eagle3_head_dir_accepted(tmp_path) -> None:
    (tmp_path / "config.json").write_text("{}")
    cfg = SpeculativeConfig.parse(
        {
            "method": "eagle3",
            "num_speculative_tokens": 5,
            "model": str(tmp_path),
            "parallel_drafting": True,
        }
    )
    assert cfg.parallel_drafting and cfg.model == str(tmp_path)


def test_cli_flag_and_epd_up_environment(monkeypatch) -> None:
    """--speculative-config for serve decode|all and up; up hands it to its services
    as EPD_SPECULATIVE_CONFIG (JSON), which they parse back."""
    from launch.cli import build_parser, engine_config
    from launch.stack import _env

    raw = '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 2}'
    for argv in (["serve", "decode"], ["serve", "all"], ["up"]):
        cfg = engine_config(build_parser().parse_args([*argv, "--speculative-config", raw]))
        assert cfg.speculative_config == SpeculativeConfig(
            method="ngram", num_speculative_tokens=3, prompt_lookup_min=2
        )
    monkeypatch.setenv("EPD_SPECULATIVE_CONFIG", _env(cfg)["EPD_SPECULATIVE_CONFIG"])
    child = engine_config(build_parser().parse_args(["serve", "decode"]))
    assert child.speculative_config == cfg.speculative_config
    bad = build_parser().parse_args(["up", "--speculative-config", raw.replace("3", "0")])
    with pytest.raises(ValueError, match="1..16"):
        engine_config(bad)
