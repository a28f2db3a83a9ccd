"""Image URLs against a real local HTTP server: fetched only from allowed hosts, never
from a non-public address unless allowed (checked after DNS and on every redirect),
bounded in size, time and redirects."""

from __future__ import annotations

import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from gateway.config import GatewayConfig
from gateway.prepare import InvalidRequest
from gateway.rest.media import MediaLoader

IMAGE = b"\x89PNG\r\n\x1a\n" + bytes(range(256)) * 40


class _Handler(BaseHTTPRequestHandler):
    def do_GET(self):  # noqa: N802 - http.server's name
        path = self.path
        if path == "/img.png":
            self._send(200, IMAGE)
        elif path.startswith("/to/"):  # /to/<host:port>/<path>
            target = path[len("/to/") :]
            self.send_response(302)
            self.send_header("Location", f"http://{target}")
            self.end_headers()
        elif path == "/slow.png":
            time.sleep(2)
            self._send(200, IMAGE)
        elif path == "/big.png":
            self._send(200, IMAGE * 100)
        else:
            self._send(404, b"no")

    def _send(self, status: int, body: bytes) -> None:
        self.send_response(status)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


class _Server(ThreadingHTTPServer):
    def handle_error(self, request, client_address):
        pass  # a client that gave up (the timeout test) is expected


@pytest.fixture(scope="module")
def http_server():
    server = _Server(("127.0.0.1", 0), _Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"127.0.0.1:{server.server_address[1]}"
    server.shutdown()


def loader(**kw) -> MediaLoader:
    base = dict(allowed_media_domains=("127.0.0.1", "localhost"), media_timeout_s=1.0)
    return MediaLoader(GatewayConfig(**{**base, **kw}))


async def test_allowed_host_and_private_addresses_allowed(http_server):
    got = await loader(allow_private_media=True).load(f"http://{http_server}/img.png")
    assert got == IMAGE
    port = http_server.split(":")[1]
    via_name = await loader(allow_private_media=True).load(f"http://localhost:{port}/img.png")
    assert via_name == IMAGE


@pytest.mark.parametrize(
    "path,kw,message",
    [
        ("img.png", {}, "non-public address"),  # loopback, private not allowed
        ("img.png", {"allowed_media_domains": ()}, "not fetched"),
        ("img.png", {"allowed_media_domains": ("example.com",)}, "not allowed"),
        ("to/example.com/img.png", {"allow_private_media": True}, "not allowed"),
        ("missing.png", {"allow_private_media": True}, "HTTP 404"),
        ("slow.png", {"allow_private_media": True}, "took over"),
        ("big.png", {"allow_private_media": True, "max_image_bytes": 20_000}, "over 20000 bytes"),
    ],
)
async def test_refused_fetches_name_the_reason(http_server, path, kw, message):
    with pytest.raises(InvalidRequest, match=message) as err:
        await loader(**kw).load(f"http://{http_server}/{path}")
    assert err.value.param == "messages"


async def test_every_redirect_hop_is_checked_like_the_first(http_server):
    port = http_server.split(":")[1]
    only_ip = loader(allowed_media_domains=("127.0.0.1",), allow_private_media=True)
    with pytest.raises(InvalidRequest, match="'localhost' is not allowed"):
        await only_ip.load(f"http://{http_server}/to/localhost:{port}/img.png")


async def test_a_name_that_resolves_to_loopback_is_refused(http_server):
    port = http_server.split(":")[1]
    with pytest.raises(InvalidRequest, match="non-public address"):
        await loader().load(f"http://localhost:{port}/img.png")


async def test_redirect_chains_are_bounded(http_server):
    url = f"http://{http_server}/img.png"
    for _ in range(5):
        url = f"http://{http_server}/to/{url.removeprefix('http://')}"
    with pytest.raises(InvalidRequest, match="redirects more than"):
        await loader(allow_private_media=True).load(url)


async def test_files_only_under_the_allowed_folder(tmp_path):
    (tmp_path / "ok.png").write_bytes(IMAGE)
    media = loader(allowed_local_media_path=str(tmp_path))
    assert await media.load(f"file://{tmp_path}/ok.png") == IMAGE
    for url in (f"file://{tmp_path}/../etc/passwd", "file:///etc/passwd"):
        with pytest.raises(InvalidRequest, match="outside"):
            await media.load(url)
    with pytest.raises(InvalidRequest, match="not allowed"):
        await loader().load(f"file://{tmp_path}/ok.png")


async def test_data_urls_are_bounded_and_checked():
    import base64

    data = base64.b64encode(IMAGE).decode()
    assert await loader().load(f"data:image/png;base64,{data}") == IMAGE
    with pytest.raises(InvalidRequest, match="over the limit"):
        await loader(max_image_bytes=1000).load(f"data:image/png;base64,{data}")
    with pytest.raises(InvalidRequest, match="base64"):
        await loader().load("data:image/png;base64,***")
    with pytest.raises(InvalidRequest, match="must be base64"):
        await loader().load("data:image/png,rawbytes")
