"""One declaration per setting: the field of a config dataclass, declared with ``setting``.

A setting's declaration holds its type (the annotation), its default, its bounds or
choices and its one docstring. Everything else is derived from it: the check at
construction (``Settings.__post_init__``), the ``EPD_<NAME>`` environment variable
(``Settings.from_env``), the ``epd`` command's ``--name`` flag (launch/cli_args.py) and
docs/configuration.md (launch/config_docs.py, kept current by a unit test).

Why dataclass metadata and not pydantic-settings: the configs are plain objects that the
engine, the tests and the offline ``LLM(**vars(config))`` build and pass around, one
process builds them once at start-up (STYLE.md 8), and the rules they need (bounds, a
few choices, a list as comma-separated text) fit in this module; vLLM's ``EngineArgs``
takes the same route. Nothing deeper in the code reads the environment.
"""

from __future__ import annotations

import dataclasses
import os
import types
import typing
from collections.abc import Mapping
from dataclasses import MISSING, field
from typing import Any

ENV_PREFIX = "EPD_"
_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}
_BOUNDS = ("ge", "gt", "le")


def setting(
    default: Any = MISSING,
    *,
    doc: str,
    factory: typing.Callable[[], Any] | None = None,
    shown: str | None = None,
    ge: float | None = None,
    gt: float | None = None,
    le: float | None = None,
    choices: tuple | None = None,
    flags: tuple[str, ...] | None = None,
    secret: bool = False,
) -> Any:
    """A config field. ``doc``: its one docstring. ``factory``: a default computed at
    construction, then ``shown`` says what it is in docs. ``ge`` / ``gt`` / ``le`` and
    ``choices`` are checked at construction (None passes: an unset optional).
    ``flags``: the option strings when not ``--<name>``; () for a setting that is an
    environment variable only. ``secret``: kept out of repr, so out of logs."""
    meta = {"doc": doc, "shown": shown, "ge": ge, "gt": gt, "le": le, "choices": choices}
    meta["flags"] = flags
    if factory is not None:
        return field(default_factory=factory, metadata=meta, repr=not secret)
    return field(default=default, metadata=meta, repr=not secret)


def env_name(f: dataclasses.Field) -> str:
    return ENV_PREFIX + f.name.upper()


def option_strings(f: dataclasses.Field) -> tuple[str, ...]:
    flags = f.metadata.get("flags")
    return ("--" + f.name.replace("_", "-"),) if flags is None else flags


def field_types(cls: type) -> dict[str, Any]:
    """Field name -> its annotation, resolved (``int | None``, ``tuple[str, ...]``)."""
    return typing.get_type_hints(cls)


def optional_inner(kind: Any) -> tuple[Any, bool]:
    """``int | None`` -> (int, True); ``int`` -> (int, False)."""
    if typing.get_origin(kind) in (typing.Union, types.UnionType):
        args = typing.get_args(kind)
        inner = [a for a in args if a is not type(None)]
        if len(inner) == 1:
            return inner[0], type(None) in args
    return kind, False


def parse_text(raw: str, kind: Any) -> Any:
    """A setting's value from its text (an environment variable, a flag)."""
    kind, optional = optional_inner(kind)
    value = raw.strip().lower()
    if kind is bool:
        if value not in _TRUE | _FALSE:  # a typo must not silently read as False
            raise ValueError(f"expected one of {sorted(_TRUE | _FALSE)}, got {raw!r}")
        return value in _TRUE
    if kind in (int, float):
        if optional and value in ("", "none", "auto"):
            return None
        return kind(raw)
    if typing.get_origin(kind) is tuple:  # a list: comma-separated
        return tuple(part.strip() for part in raw.split(",") if part.strip())
    return raw


def format_value(value: Any) -> str | None:
    """The text ``parse_text`` reads back as ``value`` (None: unset, no variable)."""
    if value is None:
        return None
    if isinstance(value, tuple):
        return ",".join(map(str, value))
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


def check_bounds(f: dataclasses.Field, value: Any) -> None:
    """Raise ValueError naming the field when ``value`` is outside its declaration."""
    if value is None:
        return
    meta, name = f.metadata, f.name
    choices = meta.get("choices")
    if choices is not None and value not in choices:
        raise ValueError(f"{name} must be one of {', '.join(map(str, choices))}, got {value!r}")
    ge, gt, le = (meta.get(k) for k in _BOUNDS)
    low_ok = (ge is None or value >= ge) and (gt is None or value > gt)
    if low_ok and (le is None or value <= le):
        return
    if le is not None:
        low = f"{ge}.." if ge is not None else f"({gt}, "
        high = f"{le}" if ge is not None else f"{le}]"
        raise ValueError(f"{name} must be in {low}{high}, got {value}")
    bound = f">= {ge}" if ge is not None else f"> {gt}"
    raise ValueError(f"{name} must be {bound}, got {value}")


class Settings:
    """Base of every config dataclass: checks each field's declaration at construction,
    then the class's own ``check`` (rules between fields, shapes no bound says), and
    reads ``EPD_*`` variables in ``from_env``."""

    def __post_init__(self) -> None:
        self.normalize()
        for f in dataclasses.fields(self):
            check_bounds(f, getattr(self, f.name))
        self.check()

    def normalize(self) -> None:
        """Bring values to their canonical form before they are checked (case, tuples)."""

    def check(self) -> None:
        """Rules the declarations cannot say; raise ValueError."""

    @classmethod
    def env_values(cls, environ: Mapping[str, str] | None = None) -> dict[str, Any]:
        """Values for this class's fields found as ``EPD_<FIELD>`` in the environment."""
        environ = os.environ if environ is None else environ
        kinds = field_types(cls)
        out = {}
        for f in dataclasses.fields(cls):
            key = env_name(f)
            if key in environ:
                try:
                    out[f.name] = parse_text(environ[key], kinds[f.name])
                except ValueError as e:
                    raise ValueError(f"{key}: {e}") from e
        return out

    @classmethod
    def from_env(cls, **overrides: Any):
        """Defaults < ``EPD_*`` variables < explicit ``overrides`` (flags; None: unset)."""
        values = cls.env_values()
        values.update({k: v for k, v in overrides.items() if v is not None})
        return cls(**values)

    def as_env(self) -> dict[str, str]:
        """The ``EPD_*`` variables that hand this config to a child process."""
        out = {}
        for f in dataclasses.fields(self):
            text = format_value(getattr(self, f.name))
            if text is not None:
                out[env_name(f)] = text
        return out
