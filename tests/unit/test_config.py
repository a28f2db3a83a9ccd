"""EngineConfig and SamplingParams reject out-of-bounds values with a message naming the
field; EngineConfig.from_env layers defaults < EPD_* variables < explicit overrides."""

from __future__ import annotations

import math
import os

import pytest

from services.config import EngineConfig
from services.sampling_params import SamplingParams

# ----------------------------------------------------------------- EngineConfig bounds

BAD_ENGINE = [
    (dict(dtype="float64"), "dtype must be"),
    (dict(load_format="pt"), "load_format must be"),
    (dict(block_size=0), "block_size must be"),
    (dict(block_size=12), "block_size must be"),
    (dict(block_size=256), "block_size must be"),
    (dict(kv_cache_memory_mb=0), "kv_cache_memory_mb must be > 0"),
    (dict(num_kv_blocks=0), "num_kv_blocks must be >= 1"),
    (dict(max_model_len=0), "max_model_len must be >= 1"),
    (dict(max_num_batched_tokens=0), "max_num_batched_tokens"),
    (dict(max_num_seqs=0), "max_num_seqs"),
    (dict(attention_backend="flash"), "attention_backend must be"),
    (dict(device="gpu"), "device must be"),
    (dict(device="cuda:x"), "device must be"),
]


@pytest.mark.parametrize("kwargs,message", BAD_ENGINE)
def test_engine_config_rejects_out_of_bounds(kwargs, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig(**kwargs)


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(block_size=1),
        dict(block_size=128),
        dict(device="cuda:1"),
        dict(device="cpu"),
        dict(dtype="bf16"),
        dict(num_kv_blocks=1, max_model_len=1),
        dict(load_format="dummy"),
    ],
)
def test_engine_config_accepts_the_bounds(kwargs):
    config = EngineConfig(**kwargs)
    assert all(getattr(config, k) == v for k, v in kwargs.items())


# ----------------------------------------------------------------- EPD_* overrides


@pytest.fixture
def env(monkeypatch):
    """Sets EPD_* variables for one test, starting from none."""
    for key in [k for k in os.environ if k.startswith("EPD_")]:
        monkeypatch.delenv(key)

    def set_env(**values: str) -> None:
        for key, value in values.items():
            monkeypatch.setenv(key, value)

    return set_env


def test_from_env_reads_typed_values(env):
    env(
        EPD_BLOCK_SIZE="8",
        EPD_MAX_MODEL_LEN="1024",
        EPD_ENABLE_PREFIX_CACHING="off",
        EPD_ENABLE_CHUNKED_PREFILL="Yes",
        EPD_DEVICE="cpu",
        EPD_MODEL="/models/x",
    )
    config = EngineConfig.from_env()
    assert (config.block_size, config.max_model_len) == (8, 1024)
    assert config.enable_prefix_caching is False and config.enable_chunked_prefill is True
    assert (config.device, config.model) == ("cpu", "/models/x")
    assert config.max_num_seqs == EngineConfig().max_num_seqs  # unset: the default


def test_from_env_none_clears_an_optional_int(env):
    env(EPD_NUM_KV_BLOCKS="none", EPD_MAX_MODEL_LEN="")
    config = EngineConfig.from_env()
    assert config.num_kv_blocks is None and config.max_model_len is None


def test_explicit_overrides_beat_the_environment(env):
    env(EPD_BLOCK_SIZE="8", EPD_SEED="5")
    config = EngineConfig.from_env(block_size=32, seed=None)  # None: flag not given
    assert (config.block_size, config.seed) == (32, 5)


@pytest.mark.parametrize(
    "key,value,message",
    [
        ("EPD_BLOCK_SIZE", "sixteen", "EPD_BLOCK_SIZE"),
        ("EPD_ENABLE_PREFIX_CACHING", "flase", "EPD_ENABLE_PREFIX_CACHING"),
        ("EPD_BLOCK_SIZE", "12", "block_size must be"),  # parsed, then bounds-checked
        ("EPD_DEVICE", "tpu", "device must be"),
    ],
)
def test_from_env_rejects_bad_values_naming_the_variable(env, key, value, message):
    env(**{key: value})
    with pytest.raises(ValueError, match=message):
        EngineConfig.from_env()


# ----------------------------------------------------------------- SamplingParams

BAD_SAMPLING = [
    (dict(temperature=-0.1), "temperature must be"),
    (dict(temperature=math.nan), "temperature must be"),
    (dict(top_k=-2), "top_k must be"),
    (dict(top_p=0.0), "top_p must be"),
    (dict(top_p=1.01), "top_p must be"),
    (dict(min_p=-0.1), "min_p must be"),
    (dict(min_p=1.5), "min_p must be"),
    (dict(presence_penalty=2.5), "presence_penalty must be"),
    (dict(frequency_penalty=-3.0), "frequency_penalty must be"),
    (dict(repetition_penalty=0.0), "repetition_penalty must be"),
    (dict(repetition_penalty=math.nan), "repetition_penalty must be"),
    (dict(repetition_penalty=math.inf), "repetition_penalty must be"),
    (dict(max_tokens=0), "max_tokens must be"),
    (dict(min_tokens=-1), "min_tokens must be"),
    (dict(min_tokens=5, max_tokens=4), "min_tokens must not exceed max_tokens"),
    (dict(logprobs=21), "logprobs must be"),
    (dict(logprobs=-1), "logprobs must be"),
    (dict(stop=[""]), "stop must be non-empty strings"),
    (dict(stop=[7]), "stop must be non-empty strings"),
    (dict(seed=1 << 63), "seed must fit in int64"),
    (dict(seed=-(1 << 63) - 1), "seed must fit in int64"),
]


@pytest.mark.parametrize("kwargs,message", BAD_SAMPLING)
def test_sampling_params_reject_out_of_bounds(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


def test_sampling_params_normalise_their_inputs():
    sp = SamplingParams(top_k=-1, stop="END", stop_token_ids=("3", 4), seed=(1 << 63) - 1)
    assert (sp.top_k, sp.stop, sp.stop_token_ids) == (0, ["END"], [3, 4])
    assert SamplingParams(temperature=0).greedy and not SamplingParams().greedy
    assert SamplingParams(presence_penalty=0.1).has_penalties
    assert not SamplingParams().has_penalties


# ----------------------------------------------------------------- GatewayConfig


def test_gateway_config_reads_lists_from_env_and_hides_keys(monkeypatch):
    from gateway.config import GatewayConfig

    monkeypatch.setenv("EPD_API_KEY", "k1, k2")
    monkeypatch.setenv("EPD_ALLOWED_MEDIA_DOMAINS", "Images.Example.com,.cdn.example.org")
    monkeypatch.setenv("EPD_MAX_N", "4")
    cfg = GatewayConfig.from_env(http_port=9000)
    assert cfg.api_key == ("k1", "k2") and cfg.max_n == 4 and cfg.http_port == 9000
    assert cfg.allowed_media_domains == ("images.example.com", ".cdn.example.org")
    assert "k1" not in repr(cfg)


@pytest.mark.parametrize(
    "kwargs,message",
    [
        (dict(http_port=70000), "http_port"),
        (dict(max_n=0), "max_n"),
        (dict(max_body_mb=0), "max_body_mb"),
        (dict(media_timeout_s=0), "media_timeout_s"),
        (dict(api_key=("",)), "api_key"),
    ],
)
def test_gateway_config_rejects_out_of_bounds(kwargs, message):
    from gateway.config import GatewayConfig

    with pytest.raises(ValueError, match=message):
        GatewayConfig(**kwargs)


def test_cache_config_reads_the_embedding_dtype_and_rejects_others(monkeypatch):
    from cache_svc.config import SemanticCacheConfig

    monkeypatch.setenv("EPD_CACHE_EMBED_DTYPE", "float32")
    assert SemanticCacheConfig.from_env().cache_embed_dtype == "float32"
    with pytest.raises(ValueError, match="cache_embed_dtype"):
        SemanticCacheConfig(cache_embed_dtype="float16")
