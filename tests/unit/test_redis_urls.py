"""Redis URLs without a server: which URLs ``services.redis_client`` accepts (and why
the rest fail at start-up), Sentinel URL parsing, and the client each URL builds."""

from __future__ import annotations

from pathlib import Path

import pytest
from redis.asyncio.connection import SSLConnection, UnixDomainSocketConnection
from redis.asyncio.sentinel import SentinelConnectionPool

from services.redis_client import check_redis_url, redis_client, sentinel_address


@pytest.fixture
def pem(tmp_path: Path) -> str:
    path = tmp_path / "ca.pem"
    path.write_text("not parsed here\n")
    return str(path)


@pytest.mark.parametrize(
    "url",
    [
        "redis://127.0.0.1:6379/0",
        "redis://:pw@h:6379/1",
        "redis://user:pw@h",
        "rediss://h:6380/0",
        "unix:///run/redis.sock?db=2",
        "redis+sentinel://h1:26379,h2:26379/mymaster",
        "rediss+sentinel://:pw@h1:26379/mymaster/3?sentinel_password=s&ssl_cert_reqs=none",
        "redis://h/0?db=3",
    ],
)
def test_accepted_urls(url: str) -> None:
    check_redis_url(url)


@pytest.mark.parametrize(
    "url,message",
    [
        ("http://:pw@h:6379", "must be redis://"),
        ("redis://h/0?socket_timeout=30", "unsupported query parameters"),
        ("redis://h/0?ssl_cert_reqs=none", "need rediss://"),
        ("redis://h/0?sentinel_password=x", "unsupported query parameters"),
        ("rediss://h/0?ssl_cert_reqs=maybe", "ssl_cert_reqs must be"),
        ("rediss://h/0?ssl_check_hostname=perhaps", "ssl_check_hostname must be"),
        ("rediss://h/0?ssl_ca_certs=/nonexistent/ca.pem", "not found"),
        ("redis+sentinel://h1/mymaster", "host:port pairs"),
        ("redis+sentinel://h1:26379", "/<master-name>"),
        ("redis+sentinel://h1:26379/m/x", "/<master-name>"),
    ],
)
def test_refused_urls_say_why_without_the_password(url: str, message: str) -> None:
    with pytest.raises(ValueError, match=message) as info:
        check_redis_url(url)
    assert "pw" not in str(info.value)


def test_client_certificate_and_key_go_together(pem: str) -> None:
    with pytest.raises(ValueError, match="go together"):
        check_redis_url(f"rediss://h/0?ssl_certfile={pem}")
    check_redis_url(f"rediss://h/0?ssl_certfile={pem}&ssl_keyfile={pem}&ssl_ca_certs={pem}")


def test_sentinel_address() -> None:
    url = "redis+sentinel://:pw@10.0.0.1:26379, sentinel-b:26380,[::1]:26381/my%2Dmaster/2"
    assert sentinel_address(url) == (
        [("10.0.0.1", 26379), ("sentinel-b", 26380), ("::1", 26381)],
        "my-master",
        2,
    )
    assert sentinel_address("redis+sentinel://h:1/m?db=4")[1:] == ("m", 4)
    assert sentinel_address("redis+sentinel://h:1/m")[1:] == ("m", 0)


async def test_plain_and_tls_urls_build_plain_clients_with_the_callers_options(pem: str) -> None:
    client = redis_client("redis://u:p%40w@h:6379/1", socket_timeout=0.5)
    kw = client.connection_pool.connection_kwargs
    assert (kw["username"], kw["password"], kw["db"], kw["socket_timeout"]) == ("u", "p@w", 1, 0.5)
    await client.aclose()
    tls = redis_client(f"rediss://h:6380/0?ssl_ca_certs={pem}&ssl_cert_reqs=required")
    assert tls.connection_pool.connection_class is SSLConnection
    assert tls.connection_pool.connection_kwargs["ssl_ca_certs"] == pem
    await tls.aclose()
    unix = redis_client("unix:///run/redis.sock?db=2")
    assert unix.connection_pool.connection_class is UnixDomainSocketConnection
    await unix.aclose()


async def test_sentinel_url_builds_a_master_client(pem: str) -> None:
    url = (
        f"rediss+sentinel://app:p%40w@s1:26379,s2:26379/mymaster/3"
        f"?sentinel_password=spw&ssl_ca_certs={pem}&ssl_check_hostname=false"
    )
    client = redis_client(url, socket_timeout=0.5, socket_connect_timeout=0.25)
    pool = client.connection_pool
    assert isinstance(pool, SentinelConnectionPool) and pool.service_name == "mymaster"
    kw = pool.connection_kwargs
    assert (kw["username"], kw["password"], kw["db"]) == ("app", "p@w", 3)
    assert (kw["ssl_ca_certs"], kw["ssl_check_hostname"], kw["socket_timeout"]) == (pem, False, 0.5)
    assert "SSL" in pool.connection_class.__name__
    sentinels = client.sentinel.sentinels
    assert [s.connection_pool.connection_kwargs["port"] for s in sentinels] == [26379, 26379]
    skw = sentinels[0].connection_pool.connection_kwargs
    assert (skw["password"], skw["socket_connect_timeout"]) == ("spw", 0.25)
    await client.aclose()
