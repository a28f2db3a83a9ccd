"""NATS credentials and TLS without a server: URL userinfo leaves the URLs (decoded) for
NatsAuth, combinations that cannot work are refused at construction, what reaches
nats-py's ``connect()``, and secrets masked in reprs and log text."""

from __future__ import annotations

import asyncio
import ssl

import nats.errors
import pytest
from nats.aio.client import Client

from services.bus.auth import NatsAuth
from services.bus.client_options import connect_options, is_refusal
from services.bus.connection import BusConfig
from services.urls import redact, split_userinfo


@pytest.mark.parametrize(
    "url,masked",
    [
        ("nats://alice:pw@h:4222", "nats://alice:***@h:4222"),
        ("nats://tok@h:4222", "nats://***@h:4222"),
        ("nats://u:p@a:1,nats://u:p@b:2", "nats://u:***@a:1,nats://u:***@b:2"),
        ("nats://u:p@ss@h:1", "nats://u:***@h:1"),  # a raw "@" in the password
        ("redis://:pw@h:6379/0", "redis://:***@h:6379/0"),
        (
            "redis+sentinel://:pw@h1:1,h2:2/m/0?sentinel_password=x&db=1",
            "redis+sentinel://:***@h1:1,h2:2/m/0?sentinel_password=***&db=1",
        ),
        (
            "error connecting to redis://127.0.0.1:6379/0",
            "error connecting to redis://127.0.0.1:6379/0",
        ),
    ],
)
def test_redact_masks_passwords_tokens_and_secret_parameters(url: str, masked: str) -> None:
    assert redact(url) == masked


def test_split_userinfo_decodes_and_tells_a_token_from_a_password() -> None:
    assert split_userinfo("nats://al%40ce:p%3Aw@h:1") == ("nats://h:1", "al@ce", "p:w")
    assert split_userinfo("nats://tok@h:1") == ("nats://h:1", "tok", None)
    assert split_userinfo("nats://u:@h:1") == ("nats://h:1", "u", "")
    assert split_userinfo("nats://h:1") == ("nats://h:1", None, None)


def test_bus_config_moves_url_credentials_into_auth() -> None:
    config = BusConfig(servers=("nats://alice:s%40cret@a:4222", "tls://alice:s%40cret@b:4222"))
    assert config.servers == ("nats://a:4222", "tls://b:4222")
    assert (config.auth.user, config.auth.password) == ("alice", "s@cret")
    assert "cret" not in repr(config)
    token = BusConfig(servers=("nats://t0k@a:4222", "nats://b:4222"))
    assert token.auth.token == "t0k" and token.servers == ("nats://a:4222", "nats://b:4222")
    assert "t0k" not in repr(token)


@pytest.mark.parametrize(
    "servers,auth,message",
    [
        (("nats://a:pw@h:1", "nats://b:pw@h:2"), NatsAuth(), "different credentials"),
        (("nats://a:pw@h:1",), NatsAuth(token="t"), "both in a URL and separately"),
        (("nats://:pw@h:1",), NatsAuth(), "password needs a user"),
        (("nats://a:@h:1",), NatsAuth(), "non-empty password"),
    ],
)
def test_inconsistent_url_credentials_are_refused(servers, auth, message) -> None:
    with pytest.raises(ValueError, match=message):
        BusConfig(servers=servers, auth=auth)


@pytest.mark.parametrize(
    "kwargs,message",
    [
        (dict(user="a", token="t", password="p"), "not both"),
        (dict(token=""), "no empty token"),
        (dict(creds_file="a.creds", nkey_seed_file="a.nk"), "creds file or an nkey seed"),
        (dict(tls_cert="c.pem"), "certificate and key go together"),
        (dict(tls_key="k.pem"), "certificate and key go together"),
    ],
)
def test_nats_auth_refuses_combinations_that_cannot_work(kwargs, message) -> None:
    with pytest.raises(ValueError, match=message):
        NatsAuth(**kwargs)


def test_creds_and_nkey_files_need_the_nkeys_package(monkeypatch) -> None:
    monkeypatch.setattr("importlib.util.find_spec", lambda name: None)
    with pytest.raises(ValueError, match="'nkeys' package"):
        NatsAuth(creds_file="user.creds")


def test_creds_and_nkey_files_reach_nats_py(monkeypatch) -> None:
    monkeypatch.setattr("importlib.util.find_spec", lambda name: object())
    assert NatsAuth(creds_file="u.creds").client_options() == {"user_credentials": "u.creds"}
    assert NatsAuth(nkey_seed_file="u.nk").client_options() == {"nkeys_seed": "u.nk"}


def test_secrets_reach_nats_py_as_guarded_callables() -> None:
    """nats-py calls them while writing CONNECT (after any TLS upgrade)."""
    calls = []
    options = NatsAuth(user="alice", password="pw").client_options(lambda: calls.append(1))
    assert (options["user"](), options["password"]()) == ("alice", "pw") and len(calls) == 2

    def refuse() -> None:
        raise nats.errors.SecureConnWantedError

    with pytest.raises(nats.errors.SecureConnWantedError):
        NatsAuth(token="t").client_options(refuse)["token"]()


async def test_connect_options_carry_timeouts_auth_and_a_verifying_tls_context(tmp_path):
    from tests.integration.secure_servers import make_pki

    pki = make_pki(tmp_path)
    auth = NatsAuth(tls_ca=str(pki.ca), tls_cert=str(pki.client_cert), tls_key=str(pki.client_key))
    config = BusConfig(servers=("nats://alice:pw@h:4222",), name="x", auth=auth)
    options = connect_options(config, Client())
    assert options["servers"] == ["nats://h:4222"] and options["name"] == "x"
    ctx = options["tls"]
    assert isinstance(ctx, ssl.SSLContext) and ctx.verify_mode == ssl.CERT_REQUIRED
    assert ctx.check_hostname and ctx.get_ca_certs()  # the private CA is trusted
    assert "tls" not in connect_options(BusConfig(), Client())  # no TLS files: no context


async def test_a_refusal_during_the_first_connect_is_reported_once() -> None:
    refused: asyncio.Future[BaseException] = asyncio.get_running_loop().create_future()
    on_error = connect_options(BusConfig(), Client(), refused)["error_cb"]
    await on_error(nats.errors.Error("nats: 'Authorization Violation'"))
    await on_error(nats.errors.Error("nats: 'Authorization Violation' again"))
    assert str(refused.result()) == "nats: 'Authorization Violation'"


@pytest.mark.parametrize(
    "exc,refusal",
    [
        (nats.errors.Error("nats: 'Authorization Violation'"), True),
        (nats.errors.Error("nats: 'Authentication Timeout'"), True),
        (ssl.SSLCertVerificationError("certificate verify failed"), True),
        (nats.errors.SecureConnWantedError(), True),
        (ConnectionRefusedError(111, "Connection refused"), False),
        (nats.errors.Error("nats: stale connection"), False),
    ],
)
def test_only_refusals_cut_the_first_connect_short(exc: BaseException, refusal: bool) -> None:
    assert is_refusal(exc) is refusal
