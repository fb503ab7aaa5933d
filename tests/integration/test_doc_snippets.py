"""Every Python block in README.md and docs/*.md runs as written.

Each block runs alone in a fresh interpreter (so it must be self-contained:
its own imports, a small LocalCluster, closing what it opens), over
UCX_TLS=tcp on loopback, and must exit 0 with nothing alarming on stderr.
A block that cannot run here (a GPU, a real cluster) is preceded by
`<!-- no-test: why -->`; every such marker must give a reason and sit
right before a Python block. New blocks are picked up by themselves.
"""

from __future__ import annotations

import glob
import os
import re
import subprocess
import sys
import tempfile
from dataclasses import dataclass

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PYTHON = {"python", "py", "python3"}
FENCE = re.compile(r"^(```+|~~~+)\s*([\w+-]*)")
MARK = re.compile(r"<!--\s*no-test\b:?(.*?)-->")


@dataclass
class Block:
    path: str  # relative to the repository root
    line: int  # of the opening fence, 1-based
    lang: str
    code: str
    skip: str | None  # the marker's reason; None when the block is run
    marked: bool  # a no-test marker precedes it (with or without a reason)

    @property
    def id(self) -> str:
        return f"{self.path}:{self.line}"


def doc_files() -> list[str]:
    return [os.path.join(ROOT, "README.md")] + sorted(glob.glob(os.path.join(ROOT, "docs", "*.md")))


def blocks(path: str) -> list[Block]:
    """Fenced blocks of one Markdown file, with the no-test marker before each."""
    with open(path, encoding="utf-8") as fh:
        lines = fh.read().splitlines()
    out, i = [], 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        fence, lang = m.group(1), m.group(2).lower()
        end = i + 1
        while end < len(lines) and not lines[end].strip().startswith(fence):
            end += 1
        before = i - 1
        while before >= 0 and not lines[before].strip():
            before -= 1
        mark = MARK.search(lines[before]) if before >= 0 else None
        reason = mark.group(1).strip() if mark else None
        out.append(Block(os.path.relpath(path, ROOT), i + 1, lang,
                         "\n".join(lines[i + 1:end]) + "\n", reason, mark is not None))
        i = end + 1
    return out


ALL = [b for path in doc_files() for b in blocks(path)]
PY = [b for b in ALL if b.lang in PYTHON]


@pytest.mark.parametrize("block", PY, ids=[b.id for b in PY])
def test_python_block_runs_as_written(block, tmp_path):
    if block.marked:
        pytest.skip(f"{block.id}: no-test: {block.skip}")
    env = dict(os.environ, UCX_TLS="tcp", UCX_NET_DEVICES="lo", UCX_WARN_UNUSED_ENV_VARS="n")
    env.pop("UCX_LOG_LEVEL", None)  # UCX's own warnings must not appear either
    env.pop("DISTORE_TOKEN_FILE", None)
    script = tmp_path / "snippet.py"
    script.write_text(block.code)
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                         timeout=300, env=env, cwd=tempfile.gettempdir(), check=False)
    where = f"{block.id} failed:\n{block.code}\n--- stdout\n{out.stdout}\n--- stderr\n{out.stderr}"
    assert out.returncode == 0, where
    for alarm in ("Traceback", "UCXX WARN", "UCX  WARN", "Warning:"):
        assert alarm not in out.stderr, where


def test_every_skipped_block_says_why_and_is_a_python_block():
    problems = []
    for b in ALL:
        if b.marked and not b.skip:
            problems.append(f"{b.id}: no-test marker without a reason (<!-- no-test: why -->)")
        if b.marked and b.lang not in PYTHON:
            problems.append(f"{b.id}: no-test marker before a {b.lang or 'plain'} block, "
                            "which is never run anyway")
    # A marker anywhere else (not right before a block) would silently do nothing.
    for path in doc_files():
        with open(path, encoding="utf-8") as fh:
            text = fh.read()
        placed = sum(b.marked for b in ALL if b.path == os.path.relpath(path, ROOT))
        found = len(re.findall(r"no-test\b", text))
        if found != placed:
            problems.append(f"{os.path.relpath(path, ROOT)}: {found} no-test markers but "
                            f"{placed} right before a block")
    assert not problems, "\n".join(problems)


def test_the_docs_have_python_blocks_that_run():
    run = [b for b in PY if not b.marked]
    skipped = [b for b in PY if b.marked]
    assert len(run) >= 2, [b.id for b in PY]
    # Skipping is the exception: most examples must run.
    assert len(skipped) <= len(run), [(b.id, b.skip) for b in skipped]


def test_the_block_finder_pairs_fences_and_reads_markers(tmp_path):
    doc = tmp_path / "x.md"
    doc.write_text("text\n```\nplain ```python not a fence\n```\n\n<!-- no-test: GPU -->\n\n"
                   "```python\nimport torch\n```\n```py\nprint(1)\n```\n"
                   "<!-- no-test -->\n```python\nx\n```\n")
    found = blocks(str(doc))
    assert [(b.line, b.lang, b.skip, b.marked) for b in found] == [
        (2, "", None, False), (8, "python", "GPU", True), (11, "py", None, False),
        (15, "python", "", True)]
    assert found[2].code == "print(1)\n"
