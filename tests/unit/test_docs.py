"""The documentation: README.md is a landing page (at most 12 KB, opening with the two
set-up commands that `.ci/run` and CI rely on), every relative link in README.md and
docs/*.md reaches an existing file (and heading), and every ```python block there runs.

A block whose first line is `# not run: <reason>` is skipped with that reason; keep them
for what needs several processes, a GPU or horovodrun. Every other block runs in a fresh
namespace in this process, from a file of its own (AutoGraph reads a function's source).
In them `tf.distribute.MirroredStrategy()` is this process's strategy over 2 of its 4
logical CPUs (`conftest.mirrored_strategy`: one strategy per process), so an example
reads as a user writes it and still trains on 2 replicas.
"""

from __future__ import annotations

import dataclasses
import glob
import os
import re
import tempfile

import keras
import pytest
import tensorflow as tf

from conftest import mirrored_strategy

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
README = os.path.join(ROOT, "README.md")
DOCS = os.path.join(ROOT, "docs")
PAGES = [README] + sorted(glob.glob(os.path.join(DOCS, "*.md")))
REQUIRED_PAGES = ("index", "pipeline", "transforms", "keras-settings", "wrappers", "writing-a-wrapper",
                  "backends", "horovod-keras", "launching", "fault-tolerance", "security", "testing", "api")
README_LIMIT = 12 * 1024
NOT_RUN = "# not run:"
MAX_NOT_RUN = 4  # blocks that cannot run here; more means examples that are not checked


def rel(path: str) -> str:
    return os.path.relpath(path, ROOT)


def read(path: str) -> str:
    with open(path, encoding="utf-8") as f:
        return f.read()


# -- the README as a landing page ------------------------------------------------------------


def test_readme_is_at_most_12_kb():
    size = len(read(README).encode("utf-8"))
    assert size <= README_LIMIT, (
        f"README.md is {size} bytes; the limit is {README_LIMIT}. Move the detail to a page "
        "in docs/ and link it.")


def test_readme_starts_with_the_two_setup_commands():
    lines = read(README).splitlines()
    assert lines[0] == "# dist_minimize" and lines[1] == ""
    assert lines[2] == "```bash" and lines[5] == "```", "the README's first block must be the set-up commands"
    assert lines[3].startswith("sudo bash ci/main_job.sh   # ")
    assert lines[4].startswith("sudo bash ci/test.sh       # ")


def test_every_topic_has_its_page_and_the_index_lists_them():
    missing = [p for p in REQUIRED_PAGES if not os.path.isfile(os.path.join(DOCS, f"{p}.md"))]
    assert not missing, f"docs/ lacks {missing}"
    index_targets = {target for _, target in links(read(os.path.join(DOCS, "index.md")))}
    pages = {os.path.basename(p) for p in glob.glob(os.path.join(DOCS, "*.md"))} - {"index.md"}
    assert pages <= index_targets, f"docs/index.md does not list {sorted(pages - index_targets)}"
    assert "docs/index.md" in {t for _, t in links(read(README))}


# -- links ------------------------------------------------------------------------------------

FENCE = re.compile(r"^```.*?^```[ \t]*$", re.S | re.M)
CODE_SPAN = re.compile(r"`[^`\n]*`")
LINK = re.compile(r"\[([^\]\n]*)\]\(([^)\s]+)\)")


def links(text: str) -> list[tuple[str, str]]:
    """(text, target) of every Markdown link outside code."""
    text = CODE_SPAN.sub("", FENCE.sub("", text))
    return LINK.findall(text)


def slugs(text: str) -> set[str]:
    """GitHub's anchors for the headings of a Markdown page."""
    seen: dict[str, int] = {}
    out = set()
    for heading in re.findall(r"^#{1,6}[ \t]+(.+?)[ \t]*$", FENCE.sub("", text), re.M):
        slug = re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-")
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        out.add(slug if n == 0 else f"{slug}-{n}")
    return out


@pytest.mark.parametrize("page", PAGES, ids=rel)
def test_relative_links_reach_existing_files(page):
    broken = []
    for label, target in links(read(page)):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # https:, mailto: ...
            continue
        path, _, anchor = target.partition("#")
        where = os.path.normpath(os.path.join(os.path.dirname(page), path)) if path else page
        if not os.path.exists(where):
            broken.append(f"[{label}]({target}): no file {rel(where)}")
        elif anchor and where.endswith(".md") and anchor not in slugs(read(where)):
            broken.append(f"[{label}]({target}): no heading #{anchor} in {rel(where)}")
    assert not broken, f"{rel(page)}: " + "; ".join(broken)


# -- code blocks ------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Block:
    page: str
    line: int  # of the code's first line, 1-based
    code: str

    @property
    def name(self) -> str:
        return f"{rel(self.page)}:{self.line}"

    @property
    def not_run_reason(self) -> str | None:
        first = self.code.lstrip("\n").splitlines()[0].strip() if self.code.strip() else ""
        return first[len(NOT_RUN):].strip() if first.startswith(NOT_RUN) else None


def python_blocks(page: str) -> list[Block]:
    blocks, code, start = [], None, 0
    for number, line in enumerate(read(page).splitlines(), 1):
        if code is None:
            if line.strip() == "```python":
                code, start = [], number + 1
        elif line.strip() == "```":
            blocks.append(Block(page, start, "\n".join(code) + "\n"))
            code = None
        else:
            code.append(line)
    assert code is None, f"{rel(page)}: a ```python block opened at line {start - 1} is not closed"
    return blocks


BLOCKS = [b for page in PAGES for b in python_blocks(page)]


def test_few_blocks_are_left_unrun():
    not_run = [b for b in BLOCKS if b.not_run_reason is not None]
    assert all(b.not_run_reason for b in not_run), "`# not run:` needs a reason"
    assert len(not_run) <= MAX_NOT_RUN, (
        f"{len(not_run)} examples are not run ({[b.name for b in not_run]}); make them small "
        "programs that run on the test process's logical CPUs")
    assert len(BLOCKS) - len(not_run) >= 5


@pytest.mark.parametrize("block", BLOCKS, ids=lambda b: b.name)
def test_python_block_runs(block, tmp_path, monkeypatch):
    if block.not_run_reason is not None:
        pytest.skip(f"{block.name}: {block.not_run_reason}")
    strategy = mirrored_strategy()
    monkeypatch.setattr(tf.distribute, "MirroredStrategy", lambda *args, **kwargs: strategy)
    monkeypatch.chdir(tmp_path)  # whatever an example writes lands here,
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # its temporary directories too
    path = tmp_path / (re.sub(r"\W", "_", block.name) + ".py")
    path.write_text(block.code)
    namespace = {"__name__": "docs_example", "__file__": str(path)}
    try:
        exec(compile(block.code, str(path), "exec"), namespace)
    finally:
        keras.mixed_precision.set_global_policy("float32")


def test_api_reference_builds_with_warnings_as_errors(tmp_path):
    """docs/api.md is generated from the docstrings by mkdocstrings; `mkdocs build
    --strict` fails on any warning (a parameter documented without a type, a reference
    that does not resolve, a page missing from the navigation)."""
    import subprocess
    import sys

    site = tmp_path / "site"
    done = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-q",
                           "-f", os.path.join(ROOT, "mkdocs.yml"), "-d", str(site)],
                          cwd=ROOT, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    api = (site / "api" / "index.html").read_text()
    for name in ("dist_minimize.Optimizer", "clip_by_global_norm", "OptimizerWrapper", "planned_collectives",
                 "AggregationError"):
        assert name in api, name
