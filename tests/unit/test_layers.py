"""Layers point one way: the shared runtime (``services/``) sits under every service and
the gateway, and the launchers (``launch/``) sit over all of them. A module under
``services/`` that imports a service package, the gateway or a launcher would make the
runtime depend on what it serves."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
UPWARD = ("gateway", "launch")


def imported_packages(path: Path) -> set[str]:
    """Top-level package of every absolute import in ``path`` (lazy ones in functions too)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.add(node.module.split(".")[0])
    return found


def is_upward(package: str) -> bool:
    return package in UPWARD or package.endswith("_svc")


def test_the_shared_runtime_imports_no_service_gateway_or_launcher():
    modules = sorted((ROOT / "services").rglob("*.py"))
    assert len(modules) > 50  # the walk found the package
    upward = {
        str(path.relative_to(ROOT)): sorted(p for p in imported_packages(path) if is_upward(p))
        for path in modules
    }
    assert {path: pkgs for path, pkgs in upward.items() if pkgs} == {}


def test_the_check_sees_lazy_imports(tmp_path):
    module = tmp_path / "m.py"
    module.write_text("def f():\n    from gateway.app import build\n    import cache_svc.keys\n")
    assert {p for p in imported_packages(module) if is_upward(p)} == {"gateway", "cache_svc"}
