"""docs/architecture.md names, for each step of a request, the file and function where it
happens. Every reference written `` `path/to/file.py Dotted.name` `` must resolve: the file
exists and the name is defined in it (read with ``ast``, no product code imported), so a
rename or a move that forgets the map fails here. Bare repository paths in backticks must
exist too."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "architecture.md"

# `gateway/core.py GatewayCore.run`: a path ending in .py, one space, a dotted name.
REFERENCE = re.compile(r"`([\w./-]+\.py) ([A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*)`")
# `services/engine/spec/`, `services/kernels/csrc/epd_extend.c`: a path under a package.
TOP = ("services", "gateway", "launch", "cache_svc", "encoder_svc", "prefill_svc")
TOP += ("decode_svc", "protos", "tests", "bench", "docs", "scripts")
BARE_PATH = re.compile(r"`((?:" + "|".join(TOP) + r")/[\w./-]*)`")


def defined_names(body: list[ast.stmt]) -> dict[str, ast.stmt]:
    """Names a module or class body defines: functions, classes, assignments (also inside
    module-level ``if`` / ``try`` blocks)."""
    names: dict[str, ast.stmt] = {}
    for node in body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            names[node.name] = node
        elif isinstance(node, ast.Assign):
            for target in node.targets:
                if isinstance(target, ast.Name):
                    names[target.id] = node
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names[node.target.id] = node
        elif isinstance(node, ast.If | ast.Try):
            for block in (node.body, node.orelse, getattr(node, "finalbody", [])):
                names.update(defined_names(block))
    return names


def problem(root: Path, path: str, dotted: str) -> str | None:
    """Why ``path dotted`` does not resolve under ``root``, or None when it does. The
    first part of ``dotted`` is looked up at module level, each further part in the body
    of the class before it."""
    file = root / path
    if not file.is_file():
        return f"{path}: no such file"
    body = ast.parse(file.read_text(), filename=str(file)).body
    owner: ast.stmt | None = None
    parent = ""
    for part in dotted.split("."):
        if owner is not None:
            if not isinstance(owner, ast.ClassDef):
                return f"{path} {dotted}: {parent} is not a class"
            body = owner.body
        owner = defined_names(body).get(part)
        if owner is None:
            return f"{path} {dotted}: {part!r} is not defined there"
        parent = part
    return None


def references(text: str) -> list[tuple[str, str]]:
    return REFERENCE.findall(text)


def test_every_code_reference_resolves():
    refs = references(DOC.read_text())
    problems = [p for path, name in refs if (p := problem(ROOT, path, name)) is not None]
    assert problems == []


def test_the_doc_has_enough_references_to_mean_something():
    refs = references(DOC.read_text())
    assert len(refs) >= 20, f"only {len(refs)} code references in {DOC.name}"
    assert len({path for path, _ in refs}) >= 20


def test_every_bare_path_exists():
    missing = [p for p in BARE_PATH.findall(DOC.read_text()) if not (ROOT / p).exists()]
    assert missing == []


def test_a_wrong_reference_is_reported(tmp_path):
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "mod.py").write_text(
        "LIMIT = 3\n"
        "def helper():\n"
        "    def inner(): ...\n"
        "class Box:\n"
        "    size: int = 0\n"
        "    def open(self): ...\n"
        "    class Lid:\n"
        "        def lift(self): ...\n"
    )
    for good in ("LIMIT", "helper", "Box", "Box.size", "Box.open", "Box.Lid.lift"):
        assert problem(tmp_path, "pkg/mod.py", good) is None, good
    assert "no such file" in problem(tmp_path, "pkg/gone.py", "Box")
    assert "'close' is not defined" in problem(tmp_path, "pkg/mod.py", "Box.close")
    assert "'Missing' is not defined" in problem(tmp_path, "pkg/mod.py", "Missing")
    # Only classes have members here: a function's locals are not part of the map.
    assert "helper is not a class" in problem(tmp_path, "pkg/mod.py", "helper.inner")
    assert "LIMIT is not a class" in problem(tmp_path, "pkg/mod.py", "LIMIT.real")


def test_the_pattern_reads_references_as_written():
    text = "see `gateway/core.py GatewayCore.run`, `a/b.py f` and `not a ref`, `x.py`"
    assert references(text) == [("gateway/core.py", "GatewayCore.run"), ("a/b.py", "f")]
