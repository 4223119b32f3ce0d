"""The docs' examples run against a real server, so a doc that drifts from the code fails here.

Pages: README.md and docs/*.md, except docs/design.md (the design log keeps history as it was).
What happens to a fenced block depends on its language:

  python       the blocks of one page run in order, in one fresh namespace, as one script: a
               later block may use the `client` an earlier one made
  sh, bash     each block runs in bash (-euo pipefail); curl fails on an HTTP error
  toml         must be a config chatd accepts (build_config), read over the page's earlier
               toml blocks, so a renamed or removed setting fails here
  yaml         must parse; json must parse line by line (JSON Lines)
  (none)       shown text (a HAProxy config), not checked

`http://127.0.0.1:8000` in a block is replaced by the test server's URL. The server serves the demo
model under the default model's name, so examples name the model a reader runs. A block that cannot
run here (it installs something, starts servers, needs a GPU or other machines) has
`<!-- not tested: why -->` on the line above its fence; each shows as a skipped test with its
reason, so what is not run stays visible (`pytest -rs`). A block that needs an optional extra has
`<!-- needs: module -->` instead: it runs where the module imports, and shows as a skip elsewhere.
A block marked `<!-- server: keys -->` runs, with the others so marked on its page, against a
second server with API keys on, `chatd_<id>_<secret>` replaced by a free-tier key (a slow test).

Links are checked too: a relative link must name a file that exists, and its #anchor a heading of
that page (GitHub's anchors). docs/tour.md must have a section "## The core path", and every
`chatd/...py` it names must exist.
"""

from __future__ import annotations

import re
import subprocess
import textwrap
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.http.serving import start_server, stop_server

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted(p for p in (ROOT / "docs").glob("*.md") if p.name != "design.md")]
DOC_URL = "http://127.0.0.1:8000"
RUN = {"python", "sh", "bash"}
CHECKED = {"toml", "json", "yaml"}
NOT_TESTED = re.compile(r"^\s*<!--\s*not tested:\s*(.+?)\s*-->\s*$")
NEEDS = re.compile(r"^\s*<!--\s*needs:\s*([\w.]+)\s*-->\s*$")
SERVER = re.compile(r"^\s*<!--\s*server:\s*(keys)\s*-->\s*$")
KEY_PLACEHOLDER = "chatd_<id>_<secret>"
FENCE = re.compile(r"^(\s*)```(\w*)\s*$")


@dataclass(frozen=True)
class Block:
    """One fenced block of a page: where it starts, its language, its text, and why it is not run."""

    page: Path
    line: int  # 1-based line of the opening fence
    language: str
    code: str
    not_tested: str | None
    needs: str | None  # a module of an optional extra; the block runs only where it imports
    server: str | None = None  # "keys": run against a server with API keys on, not the page's main one

    @property
    def name(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}"


def blocks_of(page: Path) -> list[Block]:
    """The fenced blocks of a page, their text dedented by the fence's own indent (a block in a list)."""
    lines = page.read_text().split("\n")
    found, i = [], 0
    while i < len(lines):
        opening = FENCE.match(lines[i])
        if not opening:
            i += 1
            continue
        indent, language = opening.groups()
        end = next((j for j in range(i + 1, len(lines)) if lines[j].strip() == "```"), None)
        assert end is not None, f"{page.relative_to(ROOT)}:{i + 1}: a fence that is never closed"
        previous = next((lines[j] for j in range(i - 1, -1, -1) if lines[j].strip()), "")
        marker, needs, server = NOT_TESTED.match(previous), NEEDS.match(previous), SERVER.match(previous)
        code = "\n".join(line[len(indent):] if line.startswith(indent) else line for line in lines[i + 1:end])
        found.append(Block(page, i + 1, language, textwrap.dedent(code) + "\n", marker.group(1) if marker else None,
                           needs.group(1) if needs else None, server.group(1) if server else None))
        i = end + 1
    return found


BLOCKS = [block for page in PAGES for block in blocks_of(page)]
UNTESTED = [b for b in BLOCKS if b.not_tested]
PYTHON_PAGES = sorted({b.page for b in BLOCKS if b.language == "python" and not b.not_tested and not b.server})
KEYS_PAGES = sorted({b.page for b in BLOCKS if b.language == "python" and b.server == "keys"})
SHELL_BLOCKS = [b for b in BLOCKS if b.language in ("sh", "bash") and not b.not_tested]
DATA_BLOCKS = [b for b in BLOCKS if b.language in CHECKED]


def test_the_examples_are_found():
    """A parser that found nothing would pass everything: the pages hold this many runnable blocks."""
    runnable = [b for b in BLOCKS if b.language in RUN and not b.not_tested]
    assert sum(b.language == "python" for b in runnable) >= 10 and len(SHELL_BLOCKS) >= 3, [b.name for b in runnable]


def test_every_block_has_a_language_the_test_knows():
    """A ```py or ```shell block would escape the run; a marker on a block that is never run says nothing."""
    unknown = [b.name for b in BLOCKS if b.language and b.language not in RUN | CHECKED]
    assert not unknown, f"use python, sh, bash, toml, json or yaml (or no language for shown text): {unknown}"
    idle_markers = [b.name for b in BLOCKS if (b.not_tested or b.needs or b.server) and b.language not in RUN]
    assert not idle_markers, f"only python and shell blocks run; drop the marker: {idle_markers}"


@pytest.mark.parametrize("block", UNTESTED, ids=lambda b: b.name)
def test_not_tested(block):
    """Each block marked not tested, shown as a skip with its reason."""
    pytest.skip(f"{block.name}: {block.not_tested}")


def merged(base: dict, over: dict) -> dict:
    """`over`'s tables laid over `base`'s, key by key (a list, as [[models]], is replaced whole)."""
    out = dict(base)
    for key, value in over.items():
        out[key] = merged(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


@pytest.mark.parametrize("block", [b for b in BLOCKS if b.needs], ids=lambda b: b.name)
def test_needs_its_extra(block):
    """A block that needs an optional extra (LangChain is in the slow suite's) is run by its page's
    test only where the module imports; here it shows as a skip where it does not."""
    pytest.importorskip(block.needs, reason=f"{block.name} needs {block.needs}; not installed, so not run")


@pytest.mark.parametrize("block", DATA_BLOCKS, ids=lambda b: b.name)
def test_data_block_parses(block):
    if block.language == "toml":
        import tomllib

        from chatd.config_loader import build_config

        # A config example must be one chatd starts with: each toml block of a page read over the
        # page's earlier ones (a later block may change an earlier one's alias), as load_config reads.
        values: dict = {}
        for earlier in blocks_of(block.page):
            if earlier.language == "toml" and earlier.line <= block.line:
                values = merged(values, tomllib.loads(earlier.code))
        build_config(values)
    elif block.language == "yaml":
        import yaml
        yaml.safe_load(block.code)
    else:
        import json
        for line in block.code.splitlines():
            if line.strip():
                json.loads(line)


def test_the_tour_names_files_that_exist():
    tour = (ROOT / "docs" / "tour.md").read_text()
    core = tour.split("\n## The core path\n", 1)
    assert len(core) == 2, 'docs/tour.md needs a section headed exactly "## The core path"'
    core_paths = re.findall(r"`(chatd/[\w/]+\.py)`", core[1].split("\n## ", 1)[0])
    assert len(core_paths) >= 10, core_paths
    missing = sorted({p for p in re.findall(r"chatd/[\w/]+\.py", tour) if not (ROOT / p).is_file()})
    assert not missing, f"docs/tour.md names files that do not exist: {missing}"


def heading_anchors(page: Path) -> set[str]:
    """GitHub's anchors for a page's headings: lower case, punctuation dropped, spaces as hyphens."""
    anchors = set()
    in_code = False
    for line in page.read_text().split("\n"):
        if FENCE.match(line) or line.strip() == "```":
            in_code = not in_code
        elif not in_code and (heading := re.match(r"#{1,6} (.+)", line)):
            anchors.add(re.sub(r"[^\w\- ]", "", heading.group(1).strip().lower()).replace(" ", "-"))
    return anchors


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_links_lead_somewhere(page):
    """Every relative link names a file that exists, and a #anchor a heading of that page."""
    broken = []
    for target in re.findall(r"\]\(([^)\s]+)\)", page.read_text()):
        if re.match(r"[a-z]+:", target):
            continue
        path_part, _, anchor = target.partition("#")
        path = (page.parent / path_part).resolve() if path_part else page
        if not path.exists():
            broken.append(target)
        elif anchor and path.suffix == ".md" and anchor not in heading_anchors(path):
            broken.append(target)
    assert not broken, f"{page.name}: links that lead nowhere: {broken}"


# The demo model under the default model's name, so the examples name what a reader serves;
# the default embedding model (shipped in a PyPI package, installed by the test extras).
DOCS_SERVER_CONFIG = """
[server]
model_name = ["SmolLM2-135M-Instruct.Q4_1"]
[embeddings]
model = "default"
"""


@pytest.fixture(scope="module")
def docs_server(tmp_path_factory):
    from chatd.engine.models.demo import build_demo_model

    root = tmp_path_factory.mktemp("docs")
    proc, url, log = start_server(root, build_demo_model(root / "demo"), DOCS_SERVER_CONFIG)
    try:
        yield url
    finally:
        stop_server(proc)


def importable(module: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(module) is not None


def run_python_blocks(page: Path, server: str | None, url: str, key: str = "") -> None:
    """The page's runnable python blocks for that server, in order, in one fresh namespace."""
    namespace = {"__name__": "__doc_example__"}
    for block in blocks_of(page):
        if block.language != "python" or block.not_tested or block.server != server:
            continue
        if block.needs and not importable(block.needs):
            continue
        code = block.code.replace(DOC_URL, url).replace(KEY_PLACEHOLDER, key)
        try:
            exec(compile(code, block.name, "exec", dont_inherit=True), namespace)  # not this file's __future__ imports
        except Exception as exc:
            raise AssertionError(f"the example at {block.name} failed: {exc!r}") from exc


@pytest.mark.parametrize("page", PYTHON_PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_python_examples_run(page, docs_server):
    run_python_blocks(page, None, docs_server)


@pytest.fixture(scope="module")
def keys_server(tmp_path_factory):
    """The demo model under the default model's name, with API keys on and alice on the free tier."""
    from tests.http.serving import tenants_server

    config = '[server]\nmodel_name = ["SmolLM2-135M-Instruct.Q4_1"]\n'
    with tenants_server(tmp_path_factory.mktemp("docs-keys"), config, names=("alice",), tiers={"alice": "free"}) as server:
        yield server


@pytest.mark.slow
@pytest.mark.parametrize("page", KEYS_PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_python_examples_with_keys_run(page, keys_server):
    """Blocks marked `<!-- server: keys -->`, against a server with keys on; `chatd_<id>_<secret>`
    in them is a free-tier key."""
    run_python_blocks(page, "keys", keys_server["url"], keys_server["keys"]["alice"])


@pytest.mark.parametrize("block", SHELL_BLOCKS, ids=lambda b: b.name)
def test_shell_examples_run(block, docs_server):
    script = 'curl() { command curl --fail-with-body "$@"; }\n' + block.code.replace(DOC_URL, docs_server)
    done = subprocess.run(["bash", "-euo", "pipefail", "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, f"the example at {block.name} failed:\n{done.stdout}\n{done.stderr}"
