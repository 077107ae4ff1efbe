"""The architecture the tree promises: no import cycle in mdc/ or pipelines/ (function-local imports
counted), every function-local import says why in a comment, and mdc/ never imports Ray."""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("mdc", "pipelines")


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def project_modules() -> dict[str, Path]:
    return {module_name(p): p for package in PACKAGES for p in sorted((ROOT / package).rglob("*.py"))}


def imports(tree: ast.Module, modules: dict[str, Path]):
    """(line, imported module, at module level?) for every import statement in the file; the modules
    of mdc/ and pipelines/ by their full names."""
    in_function = {
        id(node)
        for fn in ast.walk(tree)
        if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef))
        for node in ast.walk(fn)
    }
    for node in ast.walk(tree):
        names = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            # `from mdc.data import shards` imports the module mdc.data.shards, `from mdc.data.shards
            # import Sample` the module mdc.data.shards
            names = [
                f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in modules else node.module for a in node.names
            ]
        for name in names:
            yield node.lineno, name, id(node) not in in_function


def graph() -> dict[str, set[str]]:
    modules = project_modules()
    edges = {}
    for name, path in modules.items():
        tree = ast.parse(path.read_text())
        edges[name] = {target for _, target, _ in imports(tree, modules) if target in modules and target != name}
    return edges


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index, low, stack, on_stack, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in edges[v]:
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

    for v in edges:
        if v not in index:
            visit(v)
    return out


def test_cycle_finder_finds_a_planted_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_cycles_counting_function_local_imports():
    edges = graph()
    assert "mdc.registry" in edges and "mdc.config" in edges["pipelines.run.driver"]
    assert cycles(edges) == []


def test_every_function_local_import_says_why():
    """A comment on the import line, or a comment line right above the block of imports it is in."""
    missing = []
    modules = project_modules()
    for path in modules.values():
        lines = path.read_text().splitlines()
        for lineno, target, top_level in imports(ast.parse(path.read_text()), modules):
            above = lineno - 2
            while above >= 0 and lines[above].strip().startswith(("from ", "import ")):
                above -= 1
            if not top_level and "#" not in lines[lineno - 1] and not lines[above].strip().startswith("#"):
                missing.append(f"{path.relative_to(ROOT)}:{lineno} ({target})")
    assert missing == []


def test_mdc_never_imports_ray():
    modules = project_modules()
    offenders = [
        f"{path.relative_to(ROOT)}:{line}"
        for name, path in modules.items()
        if name.startswith("mdc")
        for line, target, _ in imports(ast.parse(path.read_text()), modules)
        if target.split(".")[0] == "ray"
    ]
    assert offenders == []


def objective_switches(tree: ast.AST, names: set[str]) -> list[int]:
    """Lines comparing something with an objective's name: `== "mdc"`, `!= "ar"`, `in ("bert", ...)`."""

    def named(node) -> bool:
        if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
            return any(named(e) for e in node.elts)
        return isinstance(node, ast.Constant) and node.value in names

    return [
        node.lineno
        for node in ast.walk(tree)
        if isinstance(node, ast.Compare) and any(named(side) for side in (node.left, *node.comparators))
    ]


def test_the_switch_counter_counts_a_planted_switch():
    snippet = 'if cfg.objective.name == "bert":\n    pass\nok = name in ("mdc", "cmlm")\nfine = x == "other"\n'
    assert objective_switches(ast.parse(snippet), {"mdc", "cmlm", "bert"}) == [1, 3]


def test_objectives_are_told_apart_by_the_registry_not_by_name_switches():
    """What an objective is lives in its registry entry and config class: at most 3 comparisons with
    an objective's name outside mdc/registry.py."""
    from mdc.registry import OBJECTIVES  # the names to look for; the layout tests above import nothing of mdc

    switches = [
        f"{path.relative_to(ROOT)}:{line}"
        for name, path in project_modules().items()
        if name != "mdc.registry"
        for line in objective_switches(ast.parse(path.read_text()), set(OBJECTIVES))
    ]
    assert len(switches) <= 3, switches


LAYERS = ("cli", "commands", "run", "worker", "data", "infra")  # pipelines/, top to bottom


def upward_imports(edges: dict[str, set[str]]) -> list[str]:
    """Imports from a folder of pipelines/ to one above it in LAYERS."""

    def layer(module: str) -> int | None:
        parts = module.split(".")
        return LAYERS.index(parts[1]) if parts[0] == "pipelines" and len(parts) > 2 and parts[1] in LAYERS else None

    return sorted(
        f"{source} -> {target}"
        for source, targets in edges.items()
        for target in targets
        if layer(source) is not None and layer(target) is not None and layer(target) < layer(source)
    )


def test_the_layer_check_finds_a_planted_upward_import():
    edges = {"pipelines.data.cursor": {"pipelines.worker.args", "pipelines.infra.actors"}, "pipelines.cli.runs": set()}
    assert upward_imports(edges) == ["pipelines.data.cursor -> pipelines.worker.args"]


def test_pipelines_reads_as_layers_with_no_import_running_back_up():
    """cli over commands over run (driver side) over worker over data over infra: a folder imports
    only its own and those below it (docs/design.md §1), function-local imports counted."""
    edges = graph()
    assert {p.name for p in (ROOT / "pipelines").iterdir() if p.is_dir() and p.name != "__pycache__"} == set(LAYERS)
    assert upward_imports(edges) == []
