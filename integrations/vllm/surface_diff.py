"""Which of the vLLM names the plugin relies on (``kvpress_critical_vllm.vllm_compat.SURFACE``) another vLLM version
changed, read from that version's wheel without installing it (a GPU wheel cannot be imported here):

    pip download --no-deps vllm==0.34.0 -d wheels/ && unzip -q wheels/vllm-0.34.0-*.whl 'vllm/*' -d vllm-0.34.0
    python integrations/vllm/surface_diff.py .venv-vllm/lib/python3.11/site-packages vllm-0.34.0

The first folder holds the version the plugin is built against (its ``vllm/`` package), the others the versions to
compare. Each name is looked up in the sources (a module's file, a class's or function's definition, a method's
parameters, an attribute assigned or declared in the class body): a name found in the first version and not in
another, or a method whose parameters the plugin uses that another lacks, is printed. The check is static (the
classes' bodies, not their bases), so a name that moved to a base class reads as missing: read the sources then.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from kvpress_critical_vllm.vllm_compat import SURFACE  # noqa: E402 - the plugin's folder, not an installed copy


def module_file(root: Path, module: str) -> Path | None:
    base = root / Path(*module.split("."))
    for candidate in (base.with_suffix(".py"), base / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


def find(root: Path, module: str, name: str, kind: str) -> str | None:
    """None when ``module.name`` is there as the plugin needs it, else what is wrong."""
    path = module_file(root, module)
    if path is None:
        return "module not found"
    tree = ast.parse(path.read_text())
    owner, _, member = name.partition(".")
    top = {
        node.name: node for node in tree.body if isinstance(node, ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef)
    }
    imports = [node for node in tree.body if isinstance(node, ast.ImportFrom)]
    imported = {alias.asname or alias.name for node in imports for alias in node.names}
    assignments = [node for node in tree.body if isinstance(node, ast.Assign)]
    assigned = {target.id for node in assignments for target in node.targets if isinstance(target, ast.Name)}
    if not member:
        return None if owner in top or owner in imported or owner in assigned else "not defined"
    cls = top.get(owner)
    if cls is None:
        return None if owner in imported else f"class {owner} not defined"
    if kind == "attribute":
        body = ast.unparse(cls)
        declared = any(isinstance(n, ast.AnnAssign) and getattr(n.target, "id", None) == member for n in cls.body)
        return None if declared or f"self.{member} =" in body or f"self.{member}:" in body else "attribute not found"
    functions = {n.name: n for n in cls.body if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)}
    if member not in functions:
        return "method not in the class body"
    args = functions[member].args
    names = {a.arg for a in args.posonlyargs + args.args + args.kwonlyargs}
    wanted = [p.strip() for p in kind[kind.find("(") + 1 : -1].split(",") if p.strip()]
    absent = [p for p in wanted if p not in names]
    return f"no parameter(s) {absent}" if absent else None


def main(argv: list[str]) -> int:
    if len(argv) < 2:
        print(__doc__)
        return 2
    base, others = Path(argv[0]) / "vllm", [Path(a) / "vllm" for a in argv[1:]]
    changed = 0
    for module, name, kind in SURFACE:
        module_path = module.removeprefix("vllm.")
        if find(base.parent, module, name, kind) is not None:
            continue  # not found statically in the base version either: a limit of this check, not a change
        for other in others:
            problem = find(other.parent, module, name, kind)
            if problem is not None:
                changed += 1
                print(f"{other.parent.name}: {module_path}.{name} ({kind}): {problem}")
    print(f"{changed} change(s) among {len(SURFACE)} names")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
