"""The README and the guide in docs/: the README stays short, its fresh-machine commands
stay what CI runs, every relative link lands, and every Python block compiles or runs.

The rules for code, in README.md and docs/*.md:

- Every ```python block is compiled (after `textwrap.dedent`; an IPython line magic, a
  line whose first non-blank character is `%` or `!`, counts as `pass`).
- A block whose fence comes right after a line `<!-- fragment -->` is only compiled: it
  stands for the reader's own model and data, or needs a GPU, torchrun or a framework.
- Every other block runs. A page's runnable blocks run together, concatenated in the
  page's order (so one may read what an earlier one wrote), as one script in a fresh
  Python process, in an empty temporary folder, with one thread for torch and a 120 s
  timeout. Keep them small: the demo's tiny model (`make_demo(d=32, layers=2, heads=2,
  ctx=32)`), `max_steps` ≤ 30, `display=False`.
- Other languages (```bash, ```text, a bare ```) are neither compiled nor run.

Links: every relative link target in README.md, docs/*.md and benchmarks/README.md exists,
and an anchor (`page.md#heading`, `#heading`) names a heading of that Markdown page, by
GitHub's slugs (lower case, punctuation dropped, spaces to hyphens, -1, -2 … for repeats).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
PAGES = [README, *sorted((ROOT / "docs").glob("*.md"))]
LINKED = [*PAGES, ROOT / "benchmarks" / "README.md"]
FRAGMENT = "<!-- fragment -->"
MAX_README_LINES = 250
RUN_TIMEOUT_S = 120

DEMO_COMMAND = ("python3 -m venv .venv && . .venv/bin/activate && "
                "pip install torch==2.13.0 -e . && nbwatch demo")


def rel(path: Path) -> str:
    return path.relative_to(ROOT).as_posix()


# -- Markdown, read just enough ---------------------------------------------------------
def blocks(path: Path) -> list[dict]:
    """Fenced code blocks: language, source, first line (1-based), fragment or not."""
    lines = path.read_text(encoding="utf-8").split("\n")
    out, i = [], 0
    while i < len(lines):
        m = re.match(r"^ {0,3}(`{3,}|~{3,})\s*([^`\s]*)", lines[i])
        if not m:
            i += 1
            continue
        fence, lang, start = m.group(1), m.group(2).lower(), i
        j = i + 1
        while j < len(lines) and not re.match(rf"^ {{0,3}}{fence[0]}{{{len(fence)},}}\s*$",
                                              lines[j]):
            j += 1
        out.append({"lang": lang, "src": "\n".join(lines[i + 1:j]), "line": start + 1,
                    "fragment": start > 0 and lines[start - 1].strip() == FRAGMENT})
        i = j + 1
    return out


def prose(path: Path) -> list[tuple[int, str]]:
    """The lines outside fenced code blocks, numbered from 1."""
    lines = path.read_text(encoding="utf-8").split("\n")
    inside = set()
    for b in blocks(path):
        n = b["src"].count("\n") + 1 if b["src"] else 0
        inside.update(range(b["line"], b["line"] + n + 2))  # the fences too
    return [(i, line) for i, line in enumerate(lines, 1) if i not in inside]


def slug(heading: str) -> str:
    """GitHub's anchor for a heading's text."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link: its text
    text = re.sub(r"<[^>]+>", "", text).replace("`", "")
    text = re.sub(r"[^\w\- ]", "", text.strip().lower())
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    seen: dict[str, int] = {}
    out = set()
    for _, line in prose(path):
        m = re.match(r"^ {0,3}#{1,6}\s+(.*?)\s*#*\s*$", line)
        if not m:
            continue
        s = slug(m.group(1))
        n = seen.get(s, 0)
        seen[s] = n + 1
        out.add(s if n == 0 else f"{s}-{n}")
    return out


LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")


def links(path: Path) -> list[tuple[int, str]]:
    out = []
    for i, line in prose(path):
        line = re.sub(r"(`+)(?:(?!\1).)+?\1", "", line)  # inline code is no link
        out += [(i, m.group(1)) for m in LINK.finditer(line)]
    return out


# -- (a) the README -----------------------------------------------------------------------
def ci_test_command() -> str:
    """The test command .ci/run runs: its last line that starts with python3 (the README
    gives it, letter for letter)."""
    lines = [ln.strip() for ln in (ROOT / ".ci" / "run").read_text().splitlines()
             if ln.strip().startswith("python3")]
    assert lines, ".ci/run has no python3 line"
    return lines[-1]


def test_readme_is_short():
    n = len(README.read_text(encoding="utf-8").splitlines())
    assert n <= MAX_README_LINES, (
        f"README.md has {n} lines, over {MAX_README_LINES}: move the detail into docs/")


def test_readme_gives_the_fresh_machine_commands_verbatim():
    lines = README.read_text(encoding="utf-8").splitlines()
    test_command = ci_test_command()
    assert "pytest" in test_command, test_command
    for command in (DEMO_COMMAND, test_command):
        assert command in lines, f"README.md lacks, on a line of its own: {command}"
    text = "\n".join(lines)
    assert "/usr/bin/chromium" in text and ".ci/run" in text, "the note on chromium and .ci/run"


# -- (b) links ----------------------------------------------------------------------------
def test_the_guide_has_pages():
    names = {p.name for p in PAGES}
    assert {"README.md", "index.md"} <= names, names
    readme_links = {t.split("#")[0] for _, t in links(README)}
    for page in PAGES[1:]:
        assert f"docs/{page.name}" in readme_links, f"README.md does not link docs/{page.name}"


@pytest.mark.parametrize("path", LINKED, ids=rel)
def test_relative_links_resolve(path):
    bad = []
    for line, target in links(path):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target, re.I):  # http:, https:, mailto:
            continue
        file, _, anchor = target.partition("#")
        dest = (path.parent / file).resolve() if file else path
        if not dest.exists():
            bad.append(f"{rel(path)}:{line}: {target}: no such file")
            continue
        if anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            bad.append(f"{rel(path)}:{line}: {target}: no heading #{anchor} in {rel(dest)}")
    assert not bad, "\n".join(bad)


def test_slugs_are_githubs():
    assert slug("One-file snapshots: export_html") == "one-file-snapshots-export_html"
    assert slug("Your own loop: `mon.log()`") == "your-own-loop-monlog"
    assert slug("The training batch's logits, every step") == \
        "the-training-batchs-logits-every-step"
    assert slug("Distributed (torchrun: DDP, FSDP2, several nodes)") == \
        "distributed-torchrun-ddp-fsdp2-several-nodes"


# -- (c) code -------------------------------------------------------------------------------
def python_blocks() -> list[tuple[Path, dict]]:
    return [(p, b) for p in PAGES for b in blocks(p) if b["lang"] in ("python", "py")]


def source(block: dict) -> str:
    src = textwrap.dedent(block["src"])
    return re.sub(r"(?m)^(\s*)[%!].*$", r"\1pass", src)  # IPython magics


@pytest.mark.parametrize("path,block", python_blocks(),
                         ids=[f"{rel(p)}:{b['line']}" for p, b in python_blocks()])
def test_python_blocks_compile(path, block):
    compile(source(block), f"{rel(path)}:{block['line']}", "exec")


def runnable() -> dict[Path, list[dict]]:
    pages: dict[Path, list[dict]] = {}
    for path, block in python_blocks():
        if not block["fragment"]:
            pages.setdefault(path, []).append(block)
    return pages


def test_some_blocks_run():
    """The rule above is not vacuous: the guide shows code that runs."""
    assert sum(len(b) for b in runnable().values()) >= 5, runnable()


@pytest.mark.slow
@pytest.mark.parametrize("path", list(runnable()), ids=rel)
def test_runnable_blocks_run(path, tmp_path):
    parts = [f"# --- {rel(path)}, line {b['line']}\n{source(b)}" for b in runnable()[path]]
    script = tmp_path / "blocks.py"
    script.write_text("\n\n".join(parts) + "\n", encoding="utf-8")
    work = tmp_path / "work"
    work.mkdir()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1",
           "PYTHONDONTWRITEBYTECODE": "1"}
    try:
        done = subprocess.run([sys.executable, str(script)], cwd=work, env=env,
                              capture_output=True, text=True, timeout=RUN_TIMEOUT_S)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"{rel(path)}'s blocks ran past {RUN_TIMEOUT_S} s:\n{e.stderr or ''}")
    assert done.returncode == 0, (
        f"{rel(path)}'s runnable blocks failed (exit {done.returncode}); mark a block that "
        f"cannot run alone with {FRAGMENT} on the line before its fence.\n"
        f"--- stdout\n{done.stdout[-3000:]}\n--- stderr\n{done.stderr[-6000:]}")
