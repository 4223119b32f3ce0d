"""The package layout is the architecture: imports point one way, and the engine's core needs no torch.

`http -> engine (its package's public names only), store, safety`; `safety -> engine (public
names)`; `engine` and `store` never import each other, nor http or safety; `engine/core` imports
no torch; `config` imports nothing of chatd. Every import in a module counts, those inside
functions too. (docs/design.md, "Layout".)
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

import chatd.engine

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "chatd"


def modules(folder: str) -> list[Path]:
    return sorted((PACKAGE / folder).rglob("*.py")) if folder else sorted(PACKAGE.glob("*.py"))


def imports(path: Path) -> list[tuple[str, list[str], int]]:
    """(module, names, line) for every import in a file; `import a.b` gives ("a.b", [], line)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(alias.name, [], node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.append((node.module, [alias.name for alias in node.names], node.lineno))
    return found


def violations(folder: str, forbidden) -> list[str]:
    return [f"{path.relative_to(ROOT)}:{line}: {module} {names or ''}"
            for path in modules(folder) for module, names, line in imports(path) if forbidden(module, names)]


def within(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def test_http_uses_only_the_engine_packages_public_names():
    public = set(chatd.engine.__all__)
    assert violations("http", lambda m, names: within(m, "chatd.engine") and (m != "chatd.engine" or not set(names) <= public)) == []


def test_engine_and_store_never_import_each_other_nor_http():
    assert violations("engine", lambda m, _: within(m, "chatd.store") or within(m, "chatd.http")) == []
    assert violations("store", lambda m, _: within(m, "chatd.engine") or within(m, "chatd.http")) == []


def test_safety_knows_nothing_of_http_or_the_store_and_only_the_engines_public_names():
    public = set(chatd.engine.__all__)
    assert violations("safety", lambda m, names: within(m, "chatd.http") or within(m, "chatd.store")
                      or (within(m, "chatd.engine") and (m != "chatd.engine" or not set(names) <= public))) == []
    assert violations("engine", lambda m, _: within(m, "chatd.safety")) == []


def test_engine_core_imports_no_torch():
    assert violations("engine/core", lambda m, _: within(m, "torch") or within(m, "chatd.engine.worker")) == []


def test_config_imports_nothing_of_chatd():
    assert [f"{module}:{line}" for module, _, line in imports(PACKAGE / "config.py") if within(module, "chatd")] == []


@pytest.mark.parametrize("module", ["chatd", "chatd.engine", "chatd.engine.core.scheduler", "chatd.cli"])
def test_importing_loads_no_torch(module):
    # A fresh interpreter: `chatd keys list` and reading the engine's map cost no torch import.
    code = f"import sys, {module}; print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT)
    assert out.stdout.strip() == "[]"
