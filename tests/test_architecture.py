"""Dependencies point one way: controller -> predictor -> storage, dashboard -> storage (and the pure
cost model of predictor). Every import
in the packages counts, lazy ones inside functions too (ast.walk sees them), and every import of a
project module must name one that exists (a lazy import left behind by a move fails only when run)."""
from __future__ import annotations

import ast
import functools
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# package -> the other project packages (or subpackages) it may import
ALLOWED: dict[str, tuple[str, ...]] = {
    "storage": (),
    "predictor": ("storage",),
    "controller": ("predictor", "storage"),
    # The dashboard prices traffic with the cost profiles and counterfactuals (pure code), never the controller.
    "dashboard": ("storage", "predictor.profiles", "predictor.baselines"),
    # The EAGLE3 trainer starts vLLM the way the engines do and reads the bundled traces.
    "eagle3_training": ("controller.engines", "predictor", "storage"),
}


def project_imports() -> Iterator[tuple[str, str, str, list[str]]]:
    """(package, file:line, module, names imported from it) for every import of a project module."""
    for package in ALLOWED:
        for path in sorted((ROOT / package).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if isinstance(node, ast.Import):
                    imported = [(alias.name, []) for alias in node.names]
                elif isinstance(node, ast.ImportFrom):  # relative (level > 0): shown as ".module"
                    imported = [("." * node.level + (node.module or ""), [alias.name for alias in node.names])]
                else:
                    continue
                for module, names in imported:
                    if module.startswith(".") or module.split(".")[0] in ALLOWED:
                        yield package, f"{path.relative_to(ROOT)}:{node.lineno}", module, names


def allowed(package: str, module: str, names: list[str]) -> bool:
    """`from controller import engines` is checked as controller.engines."""
    if module.startswith("."):
        return False
    targets = [f"{module}.{n}" for n in names] if module in ALLOWED else [module]
    return all(t.split(".")[0] == package or any(t == a or t.startswith(a + ".") for a in ALLOWED[package])
               for t in targets)


def test_the_scan_sees_every_package() -> None:
    packages = {package for package, *_ in project_imports()}
    assert packages == set(ALLOWED), f"no project imports found in {set(ALLOWED) - packages}"


def test_imports_point_one_way() -> None:
    bad = [f"{where}: {package} imports {module}{' (' + ', '.join(names) + ')' if names else ''}"
           for package, where, module, names in project_imports() if not allowed(package, module, names)]
    assert not bad, "imports against controller -> predictor -> storage, dashboard -> storage " \
                    "(relative imports are refused: write them absolute):\n" + "\n".join(bad)


@functools.cache
def _defined_names(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names.update((a.asname or a.name).split(".")[0] for a in node.names)
    return names


def _source(module: str) -> Path | None:
    base = ROOT.joinpath(*module.split("."))
    for path in (base.with_suffix(".py"), base / "__init__.py"):
        if path.is_file():
            return path
    return None


def test_project_imports_name_existing_modules() -> None:
    missing = []
    for _, where, module, names in project_imports():
        if module.startswith("."):
            continue  # refused by test_imports_point_one_way
        source = _source(module)
        if source is None:
            missing.append(f"{where}: no module {module}")
            continue
        for name in names:
            if name != "*" and _source(f"{module}.{name}") is None and name not in _defined_names(source):
                missing.append(f"{where}: {module} has no {name}")
    assert not missing, "imports of project modules that do not exist:\n" + "\n".join(missing)
