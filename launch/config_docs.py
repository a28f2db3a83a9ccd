"""The ``EPD_*`` variables of a config dataclass, documented from its own source: the
comment above each field is its documentation (one place for the docs; ``epd serve
--help`` prints them)."""

from __future__ import annotations

import dataclasses
import inspect
import re
import textwrap

_FIELD = re.compile(r"\s+(\w+)\s*:\s*[^=]+?(?:=|$)")


def field_comments(cls: type) -> dict[str, str]:
    """Field name -> the comment lines right above it (joined); "" when none (a field
    documented together with the one above it: the help lists them next to each other)."""
    names = {f.name for f in dataclasses.fields(cls)}
    out: dict[str, str] = {}
    pending: list[str] = []
    for line in inspect.getsource(cls).splitlines():
        stripped = line.strip()
        if stripped.startswith("#"):
            pending.append(stripped.lstrip("#").strip())
            continue
        m = _FIELD.match(line)
        if m and m.group(1) in names:
            out[m.group(1)] = " ".join(pending)
        pending = []
    return out


def _default(f: dataclasses.Field) -> str:
    if f.default is not dataclasses.MISSING:
        value = f.default
    elif f.default_factory is not dataclasses.MISSING:
        value = f.default_factory()
    else:
        return ""
    if isinstance(value, tuple):
        value = ",".join(value)
    return "" if value in (None, "", ()) else str(value)


def env_help(title: str, cls: type, width: int = 100) -> str:
    """A block for an argparse epilog: every field of ``cls`` as EPD_<NAME>, its default
    and its comment."""
    docs = field_comments(cls)
    lines = [f"{title} ({cls.__name__}):"]
    for f in dataclasses.fields(cls):
        default = _default(f)
        head = f"  EPD_{f.name.upper()}" + (f" (default {default})" if default else "")
        lines.append(head)
        if docs.get(f.name):
            lines.extend(
                textwrap.wrap(
                    docs[f.name], width, initial_indent=" " * 6, subsequent_indent=" " * 6
                )
            )
    return "\n".join(lines)
