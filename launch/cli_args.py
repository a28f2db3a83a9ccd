"""The ``epd`` command's setting flags, generated from the config classes' declarations
(services/settings.py): one ``--name`` per setting, its help the setting's docstring, its
variable and its default. ``launch.cli`` adds the groups to its subcommands and builds the
configs from what was given."""

from __future__ import annotations

import argparse
import dataclasses
from typing import Any

from services.settings import (
    env_name,
    field_types,
    format_value,
    option_strings,
    optional_inner,
    parse_text,
)


def config_classes() -> list[tuple[str, type]]:
    """Every config class, with the title its flags and docs are grouped under."""
    from cache_svc.config import SemanticCacheConfig
    from gateway.config import GatewayConfig
    from services.config import EngineConfig, ServiceConfig
    from services.observability import ObservabilityConfig

    return [
        ("engine", EngineConfig),
        ("service, bus and credentials", ServiceConfig),
        ("gateway", GatewayConfig),
        ("semantic response cache", SemanticCacheConfig),
        ("logs and metrics", ObservabilityConfig),
    ]


def shown_default(f: dataclasses.Field) -> str:
    """The default as the docs and the help show it ("" when unset)."""
    if f.metadata.get("shown") is not None:
        return f.metadata["shown"]
    if f.default is dataclasses.MISSING:
        return ""
    return format_value(f.default) or ""


_METAVARS = {int: "N", float: "X"}
# ``--model`` fills two settings (EngineConfig.model, GatewayConfig.models) and repeats
# for the commands that serve several models, so it is the one flag made by hand.
_BY_HAND = ("model", "models")


class _Text:
    """argparse ``type``: a flag's text read like its environment variable."""

    def __init__(self, kind: Any):
        self.kind = kind
        inner, _ = optional_inner(kind)
        self.__name__ = getattr(inner, "__name__", "value")  # argparse names it in errors

    def __call__(self, raw: str) -> Any:
        return parse_text(raw, self.kind)


def add_setting_flags(
    parser: argparse.ArgumentParser, title: str, cls: type, exclude: tuple[str, ...] = ()
) -> None:
    """One flag per setting of ``cls`` (those declared with flags). Unset flags leave no
    attribute (SUPPRESS), so the variables and defaults below them hold, and the same
    flag given before the subcommand (``epd --log-level DEBUG serve ...``) is kept."""
    group = parser.add_argument_group(title)
    kinds = field_types(cls)
    for f in dataclasses.fields(cls):
        flags = option_strings(f)
        if not flags or f.name in exclude or f.name in _BY_HAND:
            continue
        kind, _ = optional_inner(kinds[f.name])
        common = dict(dest=f.name, default=argparse.SUPPRESS, help=_help(f))
        if kind is bool and flags[0].startswith("--no-"):
            group.add_argument(*flags, action="store_const", const=False, **common)
        elif kind is bool:
            group.add_argument(*flags, action=argparse.BooleanOptionalAction, **common)
        elif getattr(kind, "__origin__", None) is tuple:
            group.add_argument(*flags, action="append", metavar="VALUE", **common)
        else:
            choices = f.metadata.get("choices")
            metavar = "|".join(map(str, choices)) if choices else _METAVARS.get(kind, "TEXT")
            group.add_argument(*flags, type=_Text(kinds[f.name]), metavar=metavar, **common)


def _help(f: dataclasses.Field, *also: dataclasses.Field) -> str:
    default = shown_default(f)
    names = ", ".join(env_name(g) for g in (f, *also))
    text = f"{f.metadata['doc']} [{names}" + (f"; default {default}]" if default else "]")
    return text.replace("%", "%%")


def _field(cls: type, name: str) -> dataclasses.Field:
    return next(f for f in dataclasses.fields(cls) if f.name == name)


def add_model_flag(parser: argparse.ArgumentParser) -> None:
    from gateway.config import GatewayConfig
    from services.config import EngineConfig

    model, models = _field(EngineConfig, "model"), _field(GatewayConfig, "models")
    parser.add_argument("--model", action="append", default=None, help=_help(model, models))


def env_only_epilog() -> str:
    """The subcommands' epilog: where settings are listed, and any without a flag."""
    text = (
        "Every setting is also an EPD_* environment variable (flags win over variables, "
        "variables over defaults); docs/configuration.md lists them all."
    )
    only = [
        f"  {env_name(f)}: {f.metadata['doc']}"
        for _, cls in config_classes()
        for f in dataclasses.fields(cls)
        if not option_strings(f)
    ]
    return "\n".join([text + (" Variables without a flag:" if only else ""), *only])


def config_from_args(cls: type, args: argparse.Namespace, **overrides: Any):
    """``cls`` from its defaults < ``EPD_*`` variables < the flags given < ``overrides``."""
    given = {
        f.name: getattr(args, f.name) for f in dataclasses.fields(cls) if hasattr(args, f.name)
    }
    given.update(overrides)
    return cls.from_env(**given)
