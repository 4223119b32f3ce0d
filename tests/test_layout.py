"""The package layout is the architecture: imports point one way, and the engine's core needs no torch.

`http -> engine (its package's public names only), store, safety`; `safety -> engine (public
names)`; `engine` and `store` never import each other, nor http or safety; `engine/core` imports
no torch; `config` imports nothing of chatd. No chatd module imports itself through others (no
cycles), and inside the engine imports run down a ladder: params <- core <- attention, models <-
worker <- the engine's top level. Every import in a module counts, those inside functions too.
(docs/design.md, "Layout".)
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


# -- the import graph: every import between chatd's modules -------------------------------------


def module_name(path: Path, package: Path) -> str:
    """chatd/engine/core/scheduler.py -> chatd.engine.core.scheduler; a package's __init__.py is the package."""
    parts = path.relative_to(package.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph(package: Path) -> dict[str, dict[str, str]]:
    """module -> {chatd module it imports: where (file:line)}, over every module of `package`
    (a chatd folder). Relative imports are resolved; `from a import b` is the module a.b when b is
    one, else a; imports of anything outside the package are left out."""
    paths = {module_name(path, package): path for path in sorted(package.rglob("*.py"))}
    graph = {}
    for module, path in paths.items():
        importer = module if path.name == "__init__.py" else module.rpartition(".")[0]
        edges = graph[module] = {}
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = ".".join(importer.split(".")[:len(importer.split(".")) - node.level + 1]) if node.level else ""
                base = ".".join(part for part in (base, node.module) if part)
                targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in paths else base for alias in node.names]
            else:
                continue
            for target in targets:
                while target and target not in paths:
                    target = target.rpartition(".")[0]
                if target and target != module:
                    edges.setdefault(target, f"{path.relative_to(package.parent)}:{node.lineno}")
    return graph


def cycles(graph: dict[str, dict[str, str]]) -> list[str]:
    """Each import that closes a cycle (a back edge of a depth-first walk), as the cycle it closes:
    `a -> b (a.py:3) -> a (b.py:7)`. An empty list: the graph has no cycle."""
    found, path, state = [], [], {}

    def visit(module: str) -> None:
        state[module] = "on the path"
        path.append(module)
        for target in sorted(graph[module]):
            if state.get(target) == "on the path":
                ring = path[path.index(target):] + [target]
                found.append(" -> ".join([ring[0]] + [f"{b} ({graph[a][b]})" for a, b in zip(ring, ring[1:])]))
            elif target not in state:
                visit(target)
        path.pop()
        state[module] = "done"

    for module in sorted(graph):
        if module not in state:
            visit(module)
    return found


# The engine's layers, lowest first: a module may import its own layer and those below it.
# params.py is the vocabulary every layer speaks (SamplingParams, FinishReason; it imports nothing
# of chatd); attention/ and models/ share a layer; the top is engine.py, async_engine.py and the
# package's other top-level modules.
ENGINE_LAYERS = ["params", "core", "attention and models", "worker", "the engine's top level"]


def engine_layer(module: str) -> int | None:
    """The index in ENGINE_LAYERS of a chatd.engine module; None for a module outside the engine."""
    if not within(module, "chatd.engine"):
        return None
    part = module.split(".")[2] if module.count(".") >= 2 else ""
    return {"params": 0, "core": 1, "attention": 2, "models": 2, "worker": 3}.get(part, 4)


def upward_imports(graph: dict[str, dict[str, str]]) -> list[str]:
    """`file:line: module (its layer) imports module (a higher layer)` for every import up the engine's ladder."""
    found = []
    for module, edges in sorted(graph.items()):
        for target, where in sorted(edges.items()):
            low, high = engine_layer(module), engine_layer(target)
            if low is not None and high is not None and high > low:
                found.append(f"{where}: {module} ({ENGINE_LAYERS[low]}) imports {target} ({ENGINE_LAYERS[high]})")
    return found


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


def test_no_chatd_module_imports_itself_through_others():
    assert cycles(import_graph(PACKAGE)) == []


def test_the_engines_layers_import_only_their_own_and_those_below():
    assert upward_imports(import_graph(PACKAGE)) == []


def test_the_graph_sees_relative_imports_imports_inside_functions_and_cycles(tmp_path):
    # The checks above pass on chatd only if they would fail: a made-up package with a cycle through a
    # relative import inside a function, and an import up the engine's ladder.
    files = {
        "chatd/__init__.py": "",
        "chatd/engine/__init__.py": "",
        "chatd/engine/engine.py": "from chatd.engine.worker import runner\n",
        "chatd/engine/core/__init__.py": "",
        "chatd/engine/core/sequence.py": "import torch\nfrom chatd.engine.worker.runner import Runner\n",
        "chatd/engine/worker/__init__.py": "",
        "chatd/engine/worker/runner.py": "def load():\n    from ..engine import LLMEngine\n",
    }
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    graph = import_graph(tmp_path / "chatd")
    assert cycles(graph) == ["chatd.engine.worker.runner -> chatd.engine.engine (chatd/engine/worker/runner.py:2) "
                             "-> chatd.engine.worker.runner (chatd/engine/engine.py:1)"]
    assert upward_imports(graph) == [
        "chatd/engine/core/sequence.py:2: chatd.engine.core.sequence (core) imports chatd.engine.worker.runner (worker)",
        "chatd/engine/worker/runner.py:2: chatd.engine.worker.runner (worker) imports chatd.engine.engine "
        "(the engine's top level)",
    ]


def test_no_file_passes_450_lines():
    # A file past ~400 lines is two ideas (STYLE.md); 450 is where a split is overdue.
    assert [f"{path.relative_to(ROOT)}: {n}" for path in sorted(PACKAGE.rglob("*.py"))
            if (n := len(path.read_text().splitlines())) > 450] == []


def test_config_imports_nothing_of_chatd():
    # config_tiers.py (the tiers and prices) and config_fleet.py (the aliases) are part of the
    # tree, kept apart for its size.
    parts = ("chatd.config_tiers", "chatd.config_fleet")
    assert [f"{module}:{line}" for module, _, line in imports(PACKAGE / "config.py")
            if within(module, "chatd") and module not in parts] == []
    for part in ("config_tiers.py", "config_fleet.py"):
        assert [f"{module}:{line}" for module, _, line in imports(PACKAGE / part) if within(module, "chatd")] == []


@pytest.mark.parametrize("module", ["chatd", "chatd.engine", "chatd.engine.core.scheduler", "chatd.cli"])
def test_importing_loads_no_torch(module):
    # A fresh interpreter: `chatd keys list` and reading the engine's map cost no torch import.
    code = f"import sys, {module}; print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT)
    assert out.stdout.strip() == "[]"


# chatd/engine's core path ----------------------------------------------------------------------

# The files that serve one greedy request on a Llama, as chatd/engine/__init__.py lists them: a
# reader learns how serving works from these alone; every extension lives in a file of its own.
CORE_PATH = (
    "chatd/engine/params.py",
    "chatd/engine/tokenizer.py",
    "chatd/engine/engine.py",
    "chatd/engine/step_outputs.py",
    "chatd/engine/core/sequence.py",
    "chatd/engine/core/block_manager.py",
    "chatd/engine/core/scheduler.py",
    "chatd/engine/worker/runner.py",
    "chatd/engine/worker/forward_inputs.py",
    "chatd/engine/worker/sampling_rows.py",
    "chatd/engine/worker/sampler.py",
    "chatd/engine/attention/common.py",
    "chatd/engine/attention/sdpa.py",
    "chatd/engine/models/llama.py",
    "chatd/engine/models/layers.py",
    "chatd/engine/models/rope.py",
    "chatd/engine/models/loader.py",
)
# Issue 58 asked for under 3,000 lines: the core stands at 2,951 (4,066 in these files and their
# predecessors before issue 58). Lower it as the core shrinks; never raise it to fit a change: move
# what the change adds that a greedy request does not need into an extension.
CORE_PATH_LINES = 2960

def test_the_core_path_is_the_list_the_engine_package_gives_and_fits_its_budget():
    documented = [line.split()[0] for line in chatd.engine.__doc__.splitlines()
                  if line.strip().startswith("chatd/engine/") and line.split()[0].endswith(".py")]
    assert tuple(documented) == CORE_PATH
    missing = [path for path in CORE_PATH if not (ROOT / path).is_file()]
    assert missing == []
    lines = {path: len((ROOT / path).read_text().splitlines()) for path in CORE_PATH}
    assert sum(lines.values()) <= CORE_PATH_LINES, lines


def classes_over(limit: int) -> list[str]:
    """`path: Class` for every class in chatd/ longer than `limit` lines, from its `class` line to its last."""
    return [f"{path.relative_to(ROOT)}: {node.name}" for path in sorted(PACKAGE.rglob("*.py"))
            for node in ast.walk(ast.parse(path.read_text(), str(path)))
            if isinstance(node, ast.ClassDef) and node.end_lineno - node.lineno + 1 > limit]


def test_no_class_passes_300_lines():
    # A class past 300 lines holds more than one responsibility (STYLE.md: a file is one idea).
    assert classes_over(300) == []


# chatd/http's subpackages -----------------------------------------------------------------------

# chatd/http's layers, lowest first (chatd/http/__init__.py is the map): a module may import its own
# package and the packages of lower layers; two packages of one layer never import each other.
# errors.py is the vocabulary every layer speaks; app.py and serve.py, at the top, mount and start it all.
HTTP_LAYERS = [
    {"errors"},
    {"telemetry", "tools"},
    {"openai", "admission", "models"},
    {"server"},
    {"generation"},
    {"routes"},
    {"openapi"},
    {"the top level"},
]


def http_package(module: str) -> str | None:
    """The http package of a chatd.http module (chatd.http.server.state -> "server"); None outside chatd/http."""
    if not within(module, "chatd.http"):
        return None
    part = module.split(".")[2] if module.count(".") >= 2 else ""
    return part if part in set().union(*HTTP_LAYERS) else "the top level"


def http_layer(package: str) -> int:
    return next(i for i, layer in enumerate(HTTP_LAYERS) if package in layer)


def http_imports_against_the_ladder(graph: dict[str, dict[str, str]]) -> list[str]:
    """`file:line: module (its package) imports module (a package it may not)` for every import in
    chatd/http up its ladder or across a layer."""
    found = []
    for module, edges in sorted(graph.items()):
        for target, where in sorted(edges.items()):
            low, high = http_package(module), http_package(target)
            if low is None or high is None or low == high:
                continue
            if http_layer(high) >= http_layer(low):
                found.append(f"{where}: {module} ({low}) imports {target} ({high})")
    return found


def test_every_http_module_is_in_a_package_of_the_ladder():
    folders = {path.name for path in (PACKAGE / "http").iterdir() if (path / "__init__.py").exists()}
    assert folders == set().union(*HTTP_LAYERS) - {"errors", "the top level"}
    assert sorted(path.name for path in (PACKAGE / "http").glob("*.py")) == ["__init__.py", "app.py", "errors.py",
                                                                             "serve.py"]
    for folder in folders:  # each package says what it holds and what it may import
        assert "Imports of chatd/http" in (PACKAGE / "http" / folder / "__init__.py").read_text(), folder


def test_http_packages_import_only_their_own_and_lower_layers():
    assert http_imports_against_the_ladder(import_graph(PACKAGE)) == []


def test_the_http_ladder_fails_an_upward_or_sideways_import(tmp_path):
    files = {
        "chatd/__init__.py": "",
        "chatd/http/__init__.py": "",
        "chatd/http/errors.py": "",
        "chatd/http/app.py": "from chatd.http.routes import completions\n",
        "chatd/http/admission/__init__.py": "",
        "chatd/http/admission/limits.py": "from chatd.http.errors import APIError\nfrom chatd.http.models import fleet\n",
        "chatd/http/models/__init__.py": "",
        "chatd/http/models/fleet.py": "def later():\n    from chatd.http.server.state import STATE\n",
        "chatd/http/server/__init__.py": "",
        "chatd/http/server/state.py": "from chatd.http.admission.limits import Limits\n",
        "chatd/http/routes/__init__.py": "",
        "chatd/http/routes/completions.py": "from chatd.http.server import state\n",
    }
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    assert http_imports_against_the_ladder(import_graph(tmp_path / "chatd")) == [
        "chatd/http/admission/limits.py:2: chatd.http.admission.limits (admission) imports chatd.http.models.fleet (models)",
        "chatd/http/models/fleet.py:2: chatd.http.models.fleet (models) imports chatd.http.server.state (server)",
    ]
