"""Dependencies point one way: controller -> predictor -> storage, dashboard -> storage (and the pure
cost model of predictor); inside the predictor, its sub-packages point one way too (PREDICTOR_LAYERS),
and controller.core (serving) imports only the serving sub-packages. Every import in the packages
counts, lazy ones inside functions too (ast.walk sees them), and every import of a project module
must name one that exists (a lazy import left behind by a move fails only when run)."""
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
    # The dashboard prices traffic with the cost profiles and counterfactuals (pure code), never the controller;
    # it moves aliases through storage alone (set_alias(serving_schema=True): versions were scored when stored).
    "dashboard": ("storage", "predictor.decision.profiles", "predictor.evaluation.baselines"),
    # The EAGLE3 trainer starts vLLM the way the engines do and reads the bundled traces.
    "eagle3_training": ("controller.engines", "predictor", "storage"),
}
# predictor sub-package (or top-level module) -> the other predictor sub-packages it may import;
# storage is open to every one of them. drafting and gate import no predictor.data: serving needs neither
# the trace loader nor the tokenizer.
PREDICTOR_LAYERS: dict[str, tuple[str, ...]] = {
    "__init__": (),
    "data": (),
    "decision": (),  # pure code: profiles, allocator, binary rule
    "drafting": (),
    "gate": ("drafting",),
    "replay": ("data", "drafting"),
    "evaluation": ("data", "drafting", "gate", "decision", "replay"),
    "online": ("data", "drafting", "gate", "decision", "replay", "evaluation"),
    "warmstart": ("data", "drafting", "gate", "decision", "replay", "evaluation", "online"),
}
# What controller.core, the per-step runtime the engines call, may import of the predictor.
SERVING: tuple[str, ...] = ("drafting", "gate", "decision")


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


def _targets(module: str, names: list[str]) -> list[str]:
    """The modules an import reaches: `from predictor import gate` reaches predictor.gate."""
    return [f"{module}.{n}" for n in names] if module in ALLOWED else [module]


def predictor_layer(module: str) -> str | None:
    """The PREDICTOR_LAYERS key of a predictor module (None: not under the predictor)."""
    parts = module.split(".")
    if parts[0] != "predictor":
        return None
    return parts[1] if len(parts) > 1 else "__init__"


def layer_allowed(layer: str, module: str, names: list[str]) -> bool:
    for target in _targets(module, names):
        to = predictor_layer(target)
        if to is not None and to != layer and to not in PREDICTOR_LAYERS[layer]:
            return False
    return True


def serving_allowed(module: str, names: list[str]) -> bool:
    return all(predictor_layer(t) in (None, *SERVING) for t in _targets(module, names))


def _module_of(where: str) -> str:
    return where.split(":")[0].removesuffix(".py").removesuffix("/__init__").replace("/", ".")


def test_every_predictor_module_is_in_the_layer_table() -> None:
    unknown = sorted({str(p.relative_to(ROOT)) for p in (ROOT / "predictor").rglob("*.py")
                      if predictor_layer(_module_of(str(p.relative_to(ROOT)))) not in PREDICTOR_LAYERS})
    assert not unknown, f"predictor modules outside PREDICTOR_LAYERS (add their sub-package): {unknown}"


def test_predictor_sub_packages_import_one_way() -> None:
    bad = [f"{where}: predictor.{layer} imports {module}{' (' + ', '.join(names) + ')' if names else ''}"
           for package, where, module, names in project_imports() if package == "predictor"
           for layer in [predictor_layer(_module_of(where))] if not layer_allowed(layer, module, names)]
    assert not bad, "imports against the predictor's sub-package order (PREDICTOR_LAYERS):\n" + "\n".join(bad)


def test_serving_imports_only_the_serving_sub_packages() -> None:
    bad = [f"{where}: imports {module}{' (' + ', '.join(names) + ')' if names else ''}"
           for _, where, module, names in project_imports()
           if where.startswith("controller/core/") and not serving_allowed(module, names)]
    assert not bad, f"controller.core may import only predictor.{{{', '.join(SERVING)}}}:\n" + "\n".join(bad)


def test_the_layer_checks_refuse_wrong_way_imports() -> None:
    assert layer_allowed("online", "predictor.gate.mlp", ["GatePredictor"])
    assert layer_allowed("gate", "predictor.gate.registry", ["load_gate"])
    assert not layer_allowed("gate", "predictor.online.learner", ["Batch"])
    assert not layer_allowed("drafting", "predictor.data.tokens", ["TraceTokenizer"])
    assert not layer_allowed("decision", "predictor", ["drafting"])
    assert serving_allowed("predictor.decision.allocator", ["allocate"]) and serving_allowed("storage.workloads", [])
    assert not serving_allowed("predictor.online.learner", ["Batch"])
    assert not serving_allowed("predictor.data.traces", ["TraceRecord"])


# Alias moves: the one checked, compare-and-set path (issue 28).
MOVES = {"move_alias", "promote", "promote_for_workload"}  # predictor.gate.registry's moves; each takes `expected`
THE_MOVE = ("predictor/gate/registry.py", "storage/versions.py")  # where set_alias may be called


def alias_calls() -> Iterator[tuple[str, str, ast.Call]]:
    """(file:line, called name, call) of every call of set_alias or a registry move in the packages."""
    for package in ALLOWED:
        for path in sorted((ROOT / package).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if isinstance(node, ast.Call):
                    f = node.func
                    name = f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else ""
                    if name == "set_alias" or name in MOVES:
                        yield f"{path.relative_to(ROOT)}:{node.lineno}", name, node


def _keyword(call: ast.Call, arg: str) -> ast.expr | None:
    return next((k.value for k in call.keywords if k.arg == arg), None)


def test_every_alias_move_goes_through_the_checked_compare_and_set() -> None:
    """No alias moves by set_alias outside the registry (which passes the load check) but the
    dashboard's, which has no predictor and so passes serving_schema=True (the stored checksum and the
    champion's feature schema); and every move says which version it read: the dashboard, the CLI and
    the learner alike."""
    direct = [where for where, name, call in alias_calls() if name == "set_alias" and not where.startswith(THE_MOVE)
              and not (where.startswith("dashboard/") and isinstance(v := _keyword(call, "serving_schema"), ast.Constant)
                       and v.value is True)]
    assert not direct, ("set_alias called outside predictor.gate.registry (use move_alias; the dashboard: "
                        "serving_schema=True):\n" + "\n".join(direct))
    unread = [where for where, name, call in alias_calls() if (name in MOVES or name == "set_alias")
              and not where.startswith(THE_MOVE) and _keyword(call, "expected") is None]
    assert not unread, "alias moves without expected= (the version read):\n" + "\n".join(unread)
    assert {name for _, name, _ in alias_calls()} >= {"set_alias", "move_alias"}  # the scan sees them


def test_every_stored_version_was_loaded_and_scored() -> None:
    """The product stores versions only with check= (predictor.gate.registry.check_blob): what lets
    the dashboard move aliases without loading a blob."""
    unchecked = []
    for package in ALLOWED:
        for path in sorted((ROOT / package).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if isinstance(node, ast.Call) and getattr(node.func, "id", getattr(node.func, "attr", "")) == \
                        "create_version" and _keyword(node, "check") is None:
                    unchecked.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert not unchecked, "versions stored without check= (pass predictor.gate.registry.check_blob):\n" + \
        "\n".join(unchecked)
