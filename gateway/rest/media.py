"""``image_url`` -> image bytes: data URLs, allowed http(s) hosts, files under one folder.

Remote fetches are off unless hosts are allowed (``allowed_media_domains``). An allowed
name is resolved here and every address checked: private, loopback, link-local and other
non-global addresses are refused unless ``allow_private_media``; the connection goes to
the checked address (the name travels as Host / TLS SNI), so a second DNS answer cannot
swap it; each redirect is checked the same way. Size and time are bounded.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import ipaddress
import os
import socket
from pathlib import Path
from urllib.parse import urljoin, urlsplit, urlunsplit

from gateway.config import GatewayConfig
from gateway.prepare import InvalidRequest

_MAX_REDIRECTS = 3
_PARAM = "messages"


class MediaLoader:
    def __init__(self, config: GatewayConfig):
        self.config = config
        root = config.allowed_local_media_path
        self.local_root = Path(root).resolve() if root else None

    async def load(self, url: str) -> bytes:
        """The image bytes ``url`` names; InvalidRequest when it is not allowed or fails."""
        if url.startswith("data:"):
            return await self._data_url(url)
        scheme = urlsplit(url).scheme.lower()
        if scheme in ("http", "https"):
            return await self._fetch(url)
        if scheme == "file":
            return await asyncio.to_thread(self._read_file, url)
        raise InvalidRequest(f"image URL scheme {scheme!r} is not allowed", _PARAM)

    async def _data_url(self, url: str) -> bytes:
        head, sep, payload = url.partition(",")
        if not sep or not head.endswith(";base64"):
            raise InvalidRequest(
                "a data: image URL must be base64 (data:<type>;base64,...)", _PARAM
            )
        if len(payload) * 3 // 4 > self.config.max_image_bytes + 3:
            raise InvalidRequest(
                f"an image is over the limit of {self.config.max_image_bytes} bytes", _PARAM
            )

        def decode() -> bytes:
            try:
                return base64.b64decode(payload, validate=True)
            except (binascii.Error, ValueError) as e:
                raise InvalidRequest(f"invalid base64 image data: {e}", _PARAM) from e

        return await asyncio.to_thread(decode) if len(payload) > 1 << 16 else decode()

    def _read_file(self, url: str) -> bytes:
        if self.local_root is None:
            raise InvalidRequest("file:// image URLs are not allowed on this server", _PARAM)
        path = Path(urlsplit(url).path).resolve()
        if os.path.commonpath([path, self.local_root]) != str(self.local_root):
            raise InvalidRequest("the file is outside the allowed media folder", _PARAM)
        try:
            if path.stat().st_size > self.config.max_image_bytes:
                raise InvalidRequest("the image file is over the size limit", _PARAM)
            return path.read_bytes()
        except OSError as e:
            raise InvalidRequest(f"cannot read the image file: {e.strerror}", _PARAM) from e

    async def _fetch(self, url: str) -> bytes:
        if not self.config.allowed_media_domains:
            raise InvalidRequest(
                "image URLs are not fetched by this server (send the image as a data: URL)", _PARAM
            )
        import httpx

        try:
            async with asyncio.timeout(self.config.media_timeout_s):
                async with httpx.AsyncClient(trust_env=False, follow_redirects=False) as client:
                    for _ in range(_MAX_REDIRECTS + 1):
                        location = await self._get(client, url)
                        if isinstance(location, bytes):
                            return location
                        url = urljoin(url, location)
        except TimeoutError as e:
            raise InvalidRequest(
                f"fetching the image URL took over {self.config.media_timeout_s:.0f}s", _PARAM
            ) from e
        except httpx.HTTPError as e:
            raise InvalidRequest(f"fetching the image URL failed: {e}", _PARAM) from e
        raise InvalidRequest(f"the image URL redirects more than {_MAX_REDIRECTS} times", _PARAM)

    async def _get(self, client, url: str) -> bytes | str:
        """One hop: the body, or where a redirect points."""
        parts = urlsplit(url)
        host = (parts.hostname or "").lower()
        if parts.scheme not in ("http", "https") or not self._host_allowed(host):
            raise InvalidRequest(f"image URL host {host!r} is not allowed", _PARAM)
        port = parts.port or (443 if parts.scheme == "https" else 80)
        address = await self._checked_address(host, port)
        literal = f"[{address}]" if ":" in address else address
        target = urlunsplit((parts.scheme, f"{literal}:{port}", parts.path or "/", parts.query, ""))
        headers = {"Host": parts.netloc.rsplit("@", 1)[-1], "Accept": "image/*"}
        request = client.build_request(
            "GET", target, headers=headers, extensions={"sni_hostname": host}
        )
        response = await client.send(request, stream=True)
        try:
            if response.status_code in (301, 302, 303, 307, 308):
                return response.headers.get("location", "")
            if response.status_code != 200:
                raise InvalidRequest(f"the image URL answered HTTP {response.status_code}", _PARAM)
            return await self._body(response)
        finally:
            await response.aclose()

    async def _body(self, response) -> bytes:
        limit = self.config.max_image_bytes
        if int(response.headers.get("content-length") or 0) > limit:
            raise InvalidRequest(f"the image at the URL is over {limit} bytes", _PARAM)
        body = bytearray()
        async for chunk in response.aiter_bytes():
            body += chunk
            if len(body) > limit:
                raise InvalidRequest(f"the image at the URL is over {limit} bytes", _PARAM)
        return bytes(body)

    def _host_allowed(self, host: str) -> bool:
        for allowed in self.config.allowed_media_domains:
            if host == allowed.lstrip(".") or (allowed.startswith(".") and host.endswith(allowed)):
                return True
        return False

    async def _checked_address(self, host: str, port: int) -> str:
        try:
            infos = await asyncio.get_running_loop().getaddrinfo(
                host, port, type=socket.SOCK_STREAM
            )
        except OSError as e:
            raise InvalidRequest(f"cannot resolve image URL host {host!r}", _PARAM) from e
        addresses = [ipaddress.ip_address(info[4][0].split("%")[0]) for info in infos]
        if not self.config.allow_private_media:
            for ip in addresses:
                real = getattr(ip, "ipv4_mapped", None) or ip
                if not real.is_global or real.is_multicast:
                    raise InvalidRequest(
                        f"image URL host {host!r} resolves to a non-public address ({ip})", _PARAM
                    )
        if not addresses:
            raise InvalidRequest(f"cannot resolve image URL host {host!r}", _PARAM)
        return str(addresses[0])
