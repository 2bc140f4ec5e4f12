"""The README and the documentation pages: what they claim to run offline runs as written, and they stay readable.

A fenced code block preceded by an HTML comment starting with ``<!-- offline`` claims to run as written, offline, on
the embedded model: every such Python block of README.md and docs/ is run here, each in a fresh namespace of one
interpreter. The site itself is built with warnings as errors by ``make docs`` (CI runs it).
"""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PAGES = [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]
PAGES = [p for p in PAGES if "results" not in p.relative_to(REPO).parts[:2]]
_BLOCK = re.compile(r"(?P<marker><!--[^\n]*-->\n)?```(?P<lang>[\w-]*)[^\n]*\n(?P<code>.*?)\n```", re.S)


def code_blocks(path: Path) -> list[tuple[str, str, bool]]:
    """``(language, code, claims to run offline)`` of every fenced block of a page."""
    return [
        (m["lang"], m["code"], bool(m["marker"] and m["marker"].startswith("<!-- offline")))
        for m in _BLOCK.finditer(path.read_text())
    ]


def offline_blocks() -> list[tuple[str, str]]:
    return [
        (f"{page.relative_to(REPO)}#{i}", code)
        for page in PAGES
        for i, (lang, code, offline) in enumerate(code_blocks(page))
        if offline
    ]


def test_the_readme_is_a_first_screen_with_an_offline_quick_start():
    readme = (REPO / "README.md").read_text()
    assert len(readme.splitlines()) <= 150
    blocks = code_blocks(REPO / "README.md")
    assert blocks[0][0] == "bash" and blocks[0][1].splitlines()[0].startswith("make demo")  # the two setup commands
    assert blocks[0][1].splitlines()[1].startswith("make test")
    quick_start = [code for lang, code, offline in blocks if offline and lang == "python"]
    assert len(quick_start) == 1 and "default_pipeline" in quick_start[0]
    for name in ("context =", "question =", "press =", "print(pipe("):
        assert name in quick_start[0]  # complete: nothing left for the reader to define


def test_offline_blocks_are_python_and_every_page_link_exists():
    for page in PAGES:
        for lang, _, offline in code_blocks(page):
            assert not offline or lang == "python", f"{page}: an offline block must be Python to be run"
        for target in re.findall(r"\]\(((?!https?://|#)[^)#\s]+)", page.read_text()):
            assert (page.parent / target).exists(), f"{page.relative_to(REPO)} links to {target}, which is missing"


def test_the_combinations_table_is_generated_from_the_capabilities():
    from kvpress_critical.presses.combinations import END, START, markdown

    page = (REPO / "docs" / "presses.md").read_text()
    table = page.split(START, 1)[1].split(END, 1)[0].strip()
    assert table == markdown(), (
        "docs/presses.md: run python -m kvpress_critical.presses.combinations --write docs/presses.md"
    )


@pytest.mark.slow
def test_offline_blocks_run_as_written(tmp_path):
    """Every block that claims to run offline does, on the embedded model, each in a fresh namespace."""
    blocks = offline_blocks()
    assert len(blocks) >= 2  # the README's quick start and the getting-started page's first compression
    script = (
        "import json, sys\n"
        "for where, code in json.load(open(sys.argv[1])):\n"
        "    print(f'=== {where}', flush=True)\n"
        "    exec(compile(code, where, 'exec'), {'__name__': '__main__'})\n"
    )
    (tmp_path / "blocks.json").write_text(json.dumps(blocks))
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_VERBOSITY="error")
    run = subprocess.run(
        [sys.executable, "-c", script, str(tmp_path / "blocks.json")],
        cwd=tmp_path,  # not the repository: the installed package, as a reader runs it
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    outputs = run.stdout.split("=== ")[1:]
    assert len(outputs) == len(blocks)
    for (where, code), output in zip(blocks, outputs):
        printed = output.partition("\n")[2]
        assert "print(" not in code or printed.strip(), f"{where} printed nothing"


_TEST_REFERENCE = re.compile(r"\btests/(?:[a-z_]+/)*test_[a-z0-9_]+\.py(?:::[A-Za-z0-9_]+)?")


def test_every_test_the_docs_and_the_code_cite_exists():
    """A page or a comment that points at ``tests/<folder>/test_x.py::test_name`` points at a test that exists."""
    tracked = subprocess.run(["git", "ls-files"], cwd=REPO, capture_output=True, text=True).stdout.split()
    if not tracked:
        pytest.skip("not a git checkout")
    missing = []
    for name in tracked:
        path = REPO / name
        if path.suffix not in (".md", ".py", ".sh", ".toml") or name.startswith("results/") or not path.is_file():
            continue
        base = path.parents[len(Path(name).parts) - 1 - 2] if name.startswith("integrations/vllm/") else REPO
        for number, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
            for reference in _TEST_REFERENCE.findall(line):
                file, _, test = reference.partition("::")
                target = base / file
                if not target.is_file():
                    target = REPO / file
                if not target.is_file():  # a page's table of the plugin's tests (paths in integrations/vllm/)
                    target = REPO / "integrations" / "vllm" / file
                if not target.is_file() or (test and not re.search(rf"def {test}\b", target.read_text())):
                    missing.append(f"{name}:{number}: {reference}")
    assert not missing, "\n".join(missing)
