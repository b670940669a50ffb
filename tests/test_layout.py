"""The package's architecture, enforced: imports run downward only and never in circles.

Layers, lowest first (README "Layout"): base modules (log, versions, options, refusal, selection,
processes) -> ops -> models -> layers -> runtime -> patches -> plugin -> launcher -> bench -> cli. A module may import from its own
layer or any lower one; ``ops`` never imports vLLM (it runs on the GPU box without it).
Function-level (lazy) imports count too: they are arrows all the same.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "vllm_ling"
LAYERS = {"log": 0, "versions": 0, "options": 0, "refusal": 0, "selection": 0, "processes": 0, "ops": 1,
          "models": 2, "layers": 3, "runtime": 4, "patches": 5, "plugin": 6, "launcher": 7, "bench": 8, "cli": 9}


def module_name(path: Path, root: Path = PACKAGE) -> str:
    parts = list(path.relative_to(root.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imports_of(path: Path) -> list[tuple[int, str]]:
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            # `from vllm_ling.ops import moe` is an arrow to the submodule vllm_ling.ops.moe
            # (graph() keeps the names that are modules, else the package itself)
            found += [(node.lineno, f"{node.module}.{a.name}") for a in node.names]
            found.append((node.lineno, node.module))
    return found


def layer_of(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and parts[0] == "vllm_ling" else None


def graph(root: Path = PACKAGE) -> dict[str, list[tuple[int, str]]]:
    modules = {module_name(p, root): p for p in root.rglob("*.py")}
    edges: dict[str, list[tuple[int, str]]] = {}
    for name, path in modules.items():
        found = imports_of(path)
        submodules = {(line, m.rsplit(".", 1)[0]) for line, m in found if m in modules}
        edges[name] = [(line, m) for line, m in found
                       if m in modules and m != name and (line, m) not in submodules]
    return edges


def upward_imports(edges) -> list[str]:
    bad = []
    for name, targets in edges.items():
        mine = layer_of(name)
        if mine is None:
            continue
        for line, target in targets:
            theirs = layer_of(target)
            if theirs is not None and LAYERS[theirs] > LAYERS[mine]:
                bad.append(f"{name}:{line} ({mine}) imports {target} ({theirs})")
    return bad


def cycles(edges) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index, low, stack, on_stack, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for _, w in edges.get(v, []):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for v in list(edges):
        if v not in index:
            visit(v)
    return out


def test_every_top_level_module_has_a_layer():
    tops = {p.stem if p.is_file() else p.name for p in PACKAGE.iterdir()
            if (p.suffix == ".py" and p.stem != "__init__") or (p.is_dir() and (p / "__init__.py").exists())}
    assert tops <= set(LAYERS), f"give these a layer in tests/test_layout.py: {sorted(tops - set(LAYERS))}"


def test_imports_run_downward_only():
    assert upward_imports(graph()) == []


def test_no_import_cycles():
    assert cycles(graph()) == []


def test_ops_never_import_vllm():
    offenders = [f"{module_name(p)}:{line} imports {m}" for p in (PACKAGE / "ops").rglob("*.py")
                 for line, m in imports_of(p) if m == "vllm" or m.startswith("vllm.")]
    assert offenders == []


def test_the_checks_catch_an_upward_import_and_a_cycle(tmp_path):
    """The rule can fail: a planted models -> runtime import and an ops cycle are reported."""
    pkg = tmp_path / "vllm_ling"
    for sub in ("models", "runtime", "ops"):
        (pkg / sub).mkdir(parents=True)
        (pkg / sub / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("")
    (pkg / "models" / "ling3.py").write_text("from vllm_ling.runtime import verification\n")
    (pkg / "runtime" / "verification.py").write_text("")
    (pkg / "ops" / "a.py").write_text("def f():\n    from vllm_ling.ops import b\n")
    (pkg / "ops" / "b.py").write_text("from vllm_ling.ops.a import f\n")
    edges = graph(pkg)
    assert upward_imports(edges) == [
        "vllm_ling.models.ling3:1 (models) imports vllm_ling.runtime.verification (runtime)"]
    assert cycles(edges) == [["vllm_ling.ops.a", "vllm_ling.ops.b"]]


@pytest.mark.parametrize("layer", sorted(set(LAYERS) - {"log", "versions", "options", "refusal", "selection", "processes",
                                                     "plugin"}))
def test_layer_packages_exist(layer):
    assert (PACKAGE / layer / "__init__.py").exists()


def test_measured_results_live_in_benchmarks_results():
    """benchmarks/ holds scripts and its README; every write-up of a measurement is under results/."""
    benchmarks = PACKAGE.parent / "benchmarks"
    stray = sorted(p.name for p in benchmarks.glob("*.md") if p.name != "README.md")
    assert stray == [], f"move these to benchmarks/results/: {stray}"


def test_the_ptx_global_loads_have_one_home():
    """Every CUDA source of the package reads its streamed weights through ops/ptx_loads.cuh (each
    launcher prepends it); no kernel file carries its own copy of the load."""
    copies = sorted(str(p.relative_to(PACKAGE)) for p in PACKAGE.rglob("*.cu*")
                    if "ld.global" in p.read_text())
    assert copies == ["ops/ptx_loads.cuh"]
