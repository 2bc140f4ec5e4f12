"""Run every mutant of ``mutants.py`` against the tests of its module, in a copy of the repository at a revision.

    python tests/mutants/run_mutants.py                      # this checkout's HEAD, fast tier then complete suite
    python tests/mutants/run_mutants.py --rev 1e1ef78        # an earlier revision's tests (its complete suite)
    python tests/mutants/run_mutants.py --only ops-bf16-odd-channel --out outputs/mutants/one.json
    python tests/mutants/run_mutants.py --compare outputs/mutants/before.json outputs/mutants/after.json  # a table

For each mutant: a git worktree of ``--rev`` (made once, under ``outputs/mutants/``) gets the one-line change, the
mutant's test files run there (``-x``: the first failure is enough) and the change is undone. With ``--tiers`` (the
default for HEAD) the files' fast tier runs first (``-m "not slow"``); only if it catches nothing do the slow tests
run: the result says whether the fast tier, the complete suite or neither caught it. The plugin's tests run in the
plugin's venv (``VLLM_PY``) with the worktree's ``integrations/vllm`` and package root first on ``PYTHONPATH``; the
main suite's in ``PY``'s venv with the worktree's package root first. Results go to ``--out`` (JSON, written
atomically) and a markdown table on stdout. Needs the venvs of ``make test`` and ``make test-vllm`` (``make mutants``).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
sys.path.insert(0, str(HERE))
from mutants import MUTANTS, Mutant  # noqa: E402


def worktree(rev: str) -> Path:
    """A clean worktree of ``rev`` under outputs/mutants (made once per revision)."""
    sha = subprocess.run(["git", "rev-parse", rev], cwd=REPO, check=True, capture_output=True, text=True).stdout.strip()
    folder = REPO / "outputs" / "mutants" / f"tree-{sha[:10]}"
    if not folder.exists():
        folder.parent.mkdir(parents=True, exist_ok=True)
        subprocess.run(["git", "worktree", "add", "--detach", str(folder), sha], cwd=REPO, check=True)
    status = subprocess.run(["git", "status", "--porcelain"], cwd=folder, capture_output=True, text=True).stdout
    if status.strip():
        raise SystemExit(f"{folder} has changes (an interrupted run?): `git -C {folder} checkout .` first")
    return folder


def interpreter(variable: str, venv: str) -> str:
    """The venv's interpreter named by ``variable`` (relative to the repository, as the Makefile passes it), absolute:
    the tests run in the worktree. Not resolved: the venv's ``python`` is a link to the base interpreter."""
    return os.path.join(REPO, os.environ.get(variable, os.path.join(venv, "bin", "python")))


def vllm_model() -> str:
    code = "from kvpress_critical.default_model import vllm_model_path as p; print(p())"
    return subprocess.run(
        [interpreter("PY", ".venv"), "-c", code], check=True, capture_output=True, text=True
    ).stdout.strip()


def pytest_command(mutant: Mutant, tree: Path, marker: str | None) -> tuple[list[str], dict]:
    env = dict(os.environ, HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false", TRANSFORMERS_VERBOSITY="error")
    py = interpreter("PY", ".venv")
    tests = [str(tree / test) for test in mutant.tests if (tree / test).exists()]
    if mutant.plugin:
        vllm_py = interpreter("VLLM_PY", ".venv-vllm")
        env.update(
            PYTHONPATH=f"{tree / 'integrations' / 'vllm'}{os.pathsep}{tree}",
            KVPRESS_CRITICAL_PYTHON=py,
            KVPRESS_CRITICAL_VLLM_MODEL=vllm_model(),
        )
        command = [vllm_py, "-m", "pytest", "-c", str(tree / "integrations" / "vllm" / "pyproject.toml")]
    else:
        env["PYTHONPATH"] = str(tree)
        command = [py, "-m", "pytest", "-c", str(tree / "pyproject.toml"), "--rootdir", str(tree)]
    command += ["-q", "-x", "-rfE", "-p", "no:cacheprovider", *tests]
    if marker:
        command += ["-m", marker]
    return command, env


def run_tests(mutant: Mutant, tree: Path, marker: str | None) -> dict:
    command, env = pytest_command(mutant, tree, marker)
    start = time.time()
    run = subprocess.run(command, cwd=tree, env=env, capture_output=True, text=True)
    failed = [line.split(" ", 1)[1].split(" - ")[0] for line in run.stdout.splitlines() if line.startswith("FAILED ")]
    errors = [line for line in run.stdout.splitlines() if line.startswith("ERROR ")]
    # 0: passed, 1: failures, 5: nothing selected; anything else (a crash, a collection error) also counts as caught
    return {
        "caught": run.returncode not in (0, 5),
        "returncode": run.returncode,
        "seconds": round(time.time() - start, 1),
        "first_failure": (failed or errors or [run.stdout.strip().splitlines()[-1] if run.stdout.strip() else ""])[0],
    }


def apply(mutant: Mutant, tree: Path) -> str:
    path = tree / mutant.path
    text = path.read_text()
    count = text.count(mutant.before)
    if count != 1:
        raise SystemExit(f"{mutant.name}: the line to change occurs {count} times in {mutant.path} at this revision")
    path.write_text(text.replace(mutant.before, mutant.after))
    return text


def run_mutant(mutant: Mutant, tree: Path, tiers: bool) -> dict:
    original = apply(mutant, tree)
    try:
        result = {"mutant": mutant.name, "area": mutant.area, "tests": list(mutant.tests)}
        if tiers:
            fast = run_tests(mutant, tree, "not slow")
            result["fast"] = fast
            complete = fast if fast["caught"] else run_tests(mutant, tree, "slow")
            result["complete"] = {**complete, "caught": fast["caught"] or complete["caught"]}
        else:
            result["complete"] = run_tests(mutant, tree, None)
        return result
    finally:
        (tree / mutant.path).write_text(original)


def write_atomically(path: Path, data) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(data, indent=1))
    os.replace(tmp, path)


def compare(before: Path, *after: Path) -> str:
    """A markdown table of runs' results: an earlier revision's, then this one's with its tiers (from several runs,
    the last run of a mutant counts), by mutant."""
    old = {r["mutant"]: r for r in json.loads(before.read_text())["results"]}
    new = {r["mutant"]: r for path in after for r in json.loads(path.read_text())["results"]}
    mark = {True: "yes", False: "**no**", None: "not run"}
    lines = [
        f"| mutant | area | caught at {json.loads(before.read_text())['rev']} | caught now (complete) | "
        "caught now (fast tier) | first failure now |",
        "|---|---|---|---|---|---|",
    ]
    for mutant in MUTANTS:
        was, now = old.get(mutant.name), new.get(mutant.name)
        first = now["complete"]["first_failure"].split("::")[-1] if now and now["complete"]["caught"] else ""
        lines.append(
            f"| `{mutant.name}` | {mutant.area} | {mark[was['complete']['caught'] if was else None]} | "
            f"{mark[now['complete']['caught'] if now else None]} | "
            f"{mark[now.get('fast', {}).get('caught') if now else None]} | {first} |"
        )
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rev", default="HEAD", help="the revision whose tests run (default HEAD)")
    parser.add_argument("--only", nargs="*", help="mutant names (default: all)")
    parser.add_argument("--no-tiers", action="store_true", help="run each mutant's test files once, complete")
    parser.add_argument("--out", help="results JSON (default outputs/mutants/<rev>.json; never overwritten)")
    parser.add_argument(
        "--compare", nargs="+", metavar="RUN", help="BEFORE AFTER [AFTER...]: print runs' results side by side"
    )
    args = parser.parse_args(argv)
    if args.compare:
        if len(args.compare) < 2:
            parser.error("--compare needs an earlier run and at least one later run")
        print(compare(*map(Path, args.compare)))
        return 0
    tree = worktree(args.rev)
    sha = tree.name.removeprefix("tree-")
    out = Path(args.out) if args.out else REPO / "outputs" / "mutants" / f"{sha}-{time.strftime('%Y%m%d-%H%M%S')}.json"
    if out.exists():
        raise SystemExit(f"{out} exists: results are never overwritten")
    chosen = [m for m in MUTANTS if not args.only or m.name in args.only]
    results = []
    for i, mutant in enumerate(chosen, 1):
        print(f"[{i}/{len(chosen)}] {mutant.name} ({mutant.path})", flush=True)
        results.append(run_mutant(mutant, tree, tiers=not args.no_tiers))
        line = results[-1]
        fast = line.get("fast", {}).get("caught")
        print(f"    caught: complete {line['complete']['caught']}, fast {fast}: {line['complete']['first_failure']}")
        write_atomically(out, {"rev": args.rev, "tree": str(tree), "results": results})
    print("\n| mutant | area | caught (complete) | caught (fast tier) | first failure |\n|---|---|---|---|---|")
    for r in results:
        fast = {True: "yes", False: "no", None: "-"}[r.get("fast", {}).get("caught")]
        print(f"| {r['mutant']} | {r['area']} | {'yes' if r['complete']['caught'] else 'NO'} | {fast} | "
              f"{r['complete']['first_failure']} |")  # fmt: skip
    print(f"\nresults: {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
