"""ServiceConfig's credential and TLS settings: filled from flags and EPD_* variables,
checked at construction (files exist, pairs complete, URLs consistent), and never
printed: its repr masks the passwords in the NATS and Redis URLs."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from launch.cli import build_parser, service_config
from services.config import ServiceConfig

SECRET_FIELDS = ("nats_creds", "nats_nkey_seed", "nats_tls_ca", "nats_tls_cert", "nats_tls_key")


@pytest.fixture
def pem(tmp_path: Path) -> str:
    path = tmp_path / "x.pem"
    path.write_text("-\n")
    return str(path)


@pytest.fixture
def clean_env(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    for key in [k for k in os.environ if k.startswith("EPD_")]:
        monkeypatch.delenv(key)
    return monkeypatch


def test_repr_masks_url_passwords_and_tokens() -> None:
    config = ServiceConfig(
        nats_url="nats://alice:n4ts-pw@h:4222,nats://alice:n4ts-pw@g:4222",
        redis_url="redis://:r3dis-pw@h:6379/0",
    )
    text = repr(config)
    assert "n4ts-pw" not in text and "r3dis-pw" not in text
    assert "nats://alice:***@h:4222" in text and "redis://:***@h:6379/0" in text
    assert config.nats_url.count("n4ts-pw") == 2  # the value itself is untouched
    assert "t0ken" not in repr(ServiceConfig(nats_url="nats://t0ken@h:4222"))


def test_tls_files_come_from_env_and_flags(clean_env: pytest.MonkeyPatch, pem: str) -> None:
    clean_env.setenv("EPD_NATS_TLS_CA", pem)
    assert ServiceConfig.from_env().nats_tls_ca == pem
    args = build_parser().parse_args(
        ["serve", "gateway", "--nats-tls-cert", pem, "--nats-tls-key", pem]
    )
    config = service_config(args)
    assert (config.nats_tls_ca, config.nats_tls_cert, config.nats_tls_key) == (pem, pem, pem)
    auth = config.nats_auth()
    assert (auth.tls_ca, auth.tls_cert, auth.tls_key, auth.creds_file) == (pem, pem, pem, None)


@pytest.mark.parametrize("command", [["serve", "decode"], ["up"]])
def test_every_secret_field_has_a_flag(command: list[str], pem: str) -> None:
    parser = build_parser()
    for name in SECRET_FIELDS:
        args = parser.parse_args([*command, f"--{name.replace('_', '-')}", pem])
        assert getattr(args, name) == pem


@pytest.mark.parametrize(
    "kwargs,message",
    [
        (dict(nats_tls_ca="/nonexistent/ca.pem"), "not found"),
        (dict(nats_tls_cert="PEM"), "certificate and key go together"),
        (dict(nats_creds="PEM", nats_nkey_seed="PEM"), "creds file or an nkey seed"),
        (dict(nats_url="nats://a:x@h:1,nats://b:y@h:2"), "different credentials"),
        (dict(redis_url="http://h:6379"), "must be redis://"),
        (dict(redis_url="redis://:pw@h/0?ssl_ca_certs=PEM"), "need rediss://"),
    ],
)
def test_bad_settings_fail_at_construction(kwargs: dict, message: str, pem: str) -> None:
    kwargs = {k: v.replace("PEM", pem) for k, v in kwargs.items()}
    with pytest.raises(ValueError, match=message):
        ServiceConfig(**kwargs)


def test_creds_without_the_nkeys_package_fail_at_construction(monkeypatch, pem: str) -> None:
    monkeypatch.setattr("importlib.util.find_spec", lambda name: None)
    with pytest.raises(ValueError, match="'nkeys' package"):
        ServiceConfig(nats_creds=pem)


def test_an_empty_env_value_means_unset(clean_env: pytest.MonkeyPatch) -> None:
    clean_env.setenv("EPD_NATS_CREDS", "")
    assert ServiceConfig.from_env().nats_auth().creds_file is None
