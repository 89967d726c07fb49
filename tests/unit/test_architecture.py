"""The rules of the house (docs/architecture.md): what may import what, read from the source.

Every `import` and `from … import` in loom/ counts, nested ones included, so an import hidden in a
function to dodge a cycle breaks these tests as surely as one at the top.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "loom"

# docs/architecture.md's floors: a module imports from its own floor or below. The longest
# matching prefix decides a module's floor.
FLOORS = {
    "loom.errors": 0, "loom.files": 0, "loom.heap": 0, "loom.checked": 0,
    "loom.config": 1, "loom.strategies": 1, "loom.launch": 1, "loom.models.gpt.config": 1,
    "loom.hf_config": 1, "loom.config_show": 1, "loom.layout": 1,
    "loom.plan": 2, "loom.preset_table": 2,
    "loom.data": 3, "loom.parallel": 3,
    "loom.models": 4,
    "loom.observe": 5,
    "loom.train": 6,
    "loom.cli": 7,
}
TORCH_FREE = ("loom.errors", "loom.files", "loom.heap", "loom.checked", "loom.config", "loom.strategies",
              "loom.launch", "loom.models.gpt.config", "loom.hf_config", "loom.config_show", "loom.layout",
              "loom.plan",
              "loom.preset_table")
THIRD_PARTY_HEAVY = ("torch", "numpy", "transformers", "safetensors", "tokenizers")


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def _floor(module: str) -> int:
    prefixes = [p for p in FLOORS if module == p or module.startswith(p + ".")]
    assert prefixes or module == "loom", f"{module} is on no floor: add it to docs/architecture.md and FLOORS"
    return FLOORS[max(prefixes, key=len)] if prefixes else 0


def _imports(path: Path) -> list[tuple[str, int, bool]]:
    """(imported module, line, at module level?) for every import in the file, nested included."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    top = {id(node) for node in tree.body}
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(alias.name, node.lineno, id(node) in top) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.append((node.module, node.lineno, id(node) in top))
            # `from loom.train import checkpoint`: the submodule is imported too
            found += [(f"{node.module}.{a.name}", node.lineno, id(node) in top) for a in node.names
                      if f"{node.module}.{a.name}" in MODULES]
    return found


def _loom_imports(module: str) -> set[str]:
    return {name for name, _, _ in _imports(MODULES[module]) if name in MODULES and name != module}


def test_every_module_imports_only_from_its_floor_or_below():
    wrong = []
    for module, path in MODULES.items():
        for name, line, _ in _imports(path):
            if name in MODULES and _floor(name) > _floor(module):
                wrong.append(f"{path.relative_to(ROOT)}:{line} ({module}, floor {_floor(module)}) imports "
                             f"{name} (floor {_floor(name)})")
    assert not wrong, "\n".join(wrong)


def test_there_is_no_import_cycle():
    graph = {m: _loom_imports(m) for m in MODULES}
    state: dict[str, str] = {}

    def visit(m: str, trail: list[str]) -> None:
        state[m] = "open"
        for n in sorted(graph[m]):
            if state.get(n) == "open":
                pytest.fail("import cycle: " + " → ".join(trail[trail.index(n):] + [n]))
            if n not in state:
                visit(n, trail + [n])
        state[m] = "done"

    for m in MODULES:
        if m not in state:
            visit(m, [m])


@pytest.mark.parametrize("prefix", TORCH_FREE)
def test_torch_free_modules_import_no_torch(prefix):
    """Statically: loom.plan nowhere (nested imports included); the others at module level
    (config asks torch whether CUDA exists, inside validate, only when offload is set)."""
    for module, path in MODULES.items():
        if module != prefix and not module.startswith(prefix + "."):
            continue
        for name, line, at_top in _imports(path):
            heavy = name.split(".")[0] in THIRD_PARTY_HEAVY
            assert not (heavy and (at_top or prefix == "loom.plan")), (f"{path.relative_to(ROOT)}:{line} "
                                                                       f"imports {name}")


def test_the_planner_runs_without_torch_or_training():
    """Dynamically: importing the whole planner (and the CLI's plan command) loads neither torch
    nor loom.train."""
    code = ("import sys, loom.plan.command, loom.plan.report, loom.strategies, loom.config; "
            "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'numpy') "
            "or m.startswith('loom.train') or m.startswith('loom.parallel')); print(bad)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT)
    assert out.stdout.strip() == "[]", out.stdout


def test_parallel_knows_no_concrete_model_and_no_training():
    for module in MODULES:
        if module.startswith("loom.parallel"):
            bad = {n for n in _loom_imports(module) if n.startswith(("loom.models", "loom.train"))}
            assert not bad, f"{module} imports {sorted(bad)}"


def test_no_comment_points_to_a_document_outside_the_repository():
    """Every `docs/…`, `DESIGN.md` or `*.md` a comment or docstring names exists in the repository."""
    import re

    missing = []
    for module, path in MODULES.items():
        for name in re.findall(r"\b((?:docs/)?[\w-]+\.md)\b", path.read_text(encoding="utf-8")):
            if not (ROOT / name).exists() and not (ROOT / "docs" / name).exists():
                missing.append(f"{path.relative_to(ROOT)} names {name}")
    assert not missing, "\n".join(missing)
