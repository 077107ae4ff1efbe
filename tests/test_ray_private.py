"""Ray's private names live in pipelines/infra/ray_private.py alone, and each one it reads still exists:
an upgrade that removes one fails here, naming it, instead of deep inside a run."""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import ray

from pipelines.infra import ray_private

ROOT = Path(__file__).resolve().parents[1]
PRIVATE = ("ray._private", "ray.data._internal", "ray._raylet")


def test_every_private_name_used_exists_in_the_installed_ray():
    missing = [
        f"{module}.{name}" for module, name in ray_private.USED if not hasattr(importlib.import_module(module), name)
    ]
    assert not missing, f"Ray {ray.__version__} lacks {missing}: adapt pipelines/infra/ray_private.py"


def test_the_installed_ray_is_one_the_private_module_was_tested_on():
    assert ray.__version__ in ray_private.TESTED_RAY_VERSIONS, (
        f"Ray {ray.__version__} is not in ray_private.TESTED_RAY_VERSIONS {ray_private.TESTED_RAY_VERSIONS}: "
        "run the suite on it, then add it there and to pyproject.toml's range"
    )


def private_imports(path: Path) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        names = (
            [a.name for a in node.names]
            if isinstance(node, ast.Import)
            else [node.module or ""]
            if isinstance(node, ast.ImportFrom)
            else []
        )
        found += [f"{path.relative_to(ROOT)}:{node.lineno} {n}" for n in names if n.startswith(PRIVATE)]
        if isinstance(node, ast.Attribute) and ast.unparse(node).startswith(PRIVATE):
            found.append(f"{path.relative_to(ROOT)}:{node.lineno} {ast.unparse(node)}")
    return found


def test_no_private_ray_import_outside_the_one_module():
    sources = [p for folder in ("mdc", "pipelines", "benchmarks") for p in (ROOT / folder).rglob("*.py")]
    found = [hit for p in sources if p != ROOT / "pipelines" / "infra" / "ray_private.py" for hit in private_imports(p)]
    assert found == []
    assert private_imports(ROOT / "pipelines" / "infra" / "ray_private.py")  # the scan sees what it looks for


def test_the_strict_repartition_asks_no_cpu_and_runs_one_task_at_a_time():
    ds = ray.data.range(10).repartition(target_num_rows_per_block=4, strict=True)  # lazy: starts no Ray
    operator = ray_private.repartition_in_one_task(ds)._logical_plan.dag
    assert operator.ray_remote_args["num_cpus"] == 0
    assert operator.compute.size == 1
