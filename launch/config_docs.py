"""docs/configuration.md, generated from the config classes' declarations (every setting:
its flag, its ``EPD_*`` variable, its default, its docstring). A unit test fails when the
file is stale; ``python -m launch.config_docs`` writes it anew."""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

from launch.cli_args import config_classes, shown_default
from services.settings import env_name, field_types, option_strings

DOC = Path(__file__).resolve().parents[1] / "docs" / "configuration.md"

HEAD = """# Configuration

Every setting of every service, generated from its one declaration (the config classes
below, declared with `setting` in `services/settings.py`). Set one as a flag of `epd serve`
/ `epd up` or as its `EPD_*` environment variable (Docker compose passes variables): flags
win over variables, variables over defaults. Lists are comma-separated in a variable and
repeated as flags; booleans read `1/true/yes/on` or `0/false/no/off`; an unset optional
number reads `none`.

Do not edit by hand: `python -m launch.config_docs` writes this file, and
`tests/unit/test_configuration_doc.py` fails when it is stale.
"""


def _type_name(kind) -> str:
    text = getattr(kind, "__name__", None) if not hasattr(kind, "__args__") else None
    text = text or str(kind).replace("typing.", "")
    return text.replace("NoneType", "None").replace("tuple[str, ...]", "list")


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def render() -> str:
    parts = [HEAD]
    for title, cls in config_classes():
        module = cls.__module__.replace(".", "/") + ".py"
        doc = (cls.__doc__ or "").strip()
        parts.append(f"## {title[0].upper()}{title[1:]} (`{module} {cls.__name__}`)\n\n{doc}\n")
        parts.append("| Variable | Flag | Type | Default | Meaning |\n|---|---|---|---|---|")
        kinds = field_types(cls)
        for f in dataclasses.fields(cls):
            flags = ", ".join(f"`{o}`" for o in option_strings(f)) or "(variable only)"
            default = shown_default(f)
            cells = [
                f"`{env_name(f)}`",
                flags,
                f"`{_type_name(kinds[f.name])}`",
                f"`{default}`" if default else "unset",
                f.metadata["doc"],
            ]
            parts.append("| " + " | ".join(_cell(c) for c in cells) + " |")
        parts.append("")
    return "\n".join(parts).rstrip() + "\n"


def main() -> int:
    DOC.write_text(render())
    print(f"wrote {DOC}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
