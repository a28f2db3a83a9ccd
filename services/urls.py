"""Secrets in server URLs: take them out for the client, mask them for logs.

NATS and Redis URLs may carry a password or token (``nats://user:pw@host``,
``redis://:pw@host``, ``...?sentinel_password=pw``). Everything that prints a URL, a
config or an error that may quote one goes through ``redact`` first (DESIGN.md, Bus:
secrets never reach logs).
"""

from __future__ import annotations

import re
from urllib.parse import unquote, urlsplit, urlunsplit

MASK = "***"

# scheme://userinfo@ ; userinfo runs to the last "@" before the next "/" (as urlsplit
# reads it), so a raw "@" in a password is masked too and "nats://a@h1,nats://b@h2" is
# masked URL by URL (the "//" of the second URL ends the first one's match).
_USERINFO = re.compile(r"([a-zA-Z][a-zA-Z0-9+.-]*://)([^/\s]*)@")
# Query parameters whose name says they hold a secret.
_SECRET_PARAM = re.compile(r"([?&][^=&#\s]*(?:pass|token|secret)[^=&#\s]*=)[^&#\s]*", re.I)


def _mask_userinfo(match: re.Match[str]) -> str:
    scheme, userinfo = match.group(1), match.group(2)
    user, sep, _ = userinfo.partition(":")
    # "user:password" keeps the user (who connected is useful in a log); a lone
    # "token" is all secret.
    return f"{scheme}{user}:{MASK}@" if sep else f"{scheme}{MASK}@"


def redact(text: str) -> str:
    """``text`` with every URL password, token and secret query value masked."""
    return _SECRET_PARAM.sub(rf"\g<1>{MASK}", _USERINFO.sub(_mask_userinfo, text))


def split_userinfo(url: str) -> tuple[str, str | None, str | None]:
    """(the URL without userinfo, user, password), both percent-decoded.

    ``nats://tok@h`` gives ("nats://h", "tok", None): a lone user is a NATS token.
    An empty password (``user:@h``) reads as "" so callers can reject it.
    """
    parts = urlsplit(url)
    userinfo, at, hostport = parts.netloc.rpartition("@")
    if not at:
        return url, None, None
    user, sep, password = userinfo.partition(":")
    clean = urlunsplit(parts._replace(netloc=hostport))
    return clean, unquote(user), unquote(password) if sep else None
