"""The CLI answers `--help` and config errors without torch, Ray or MLflow (seconds each to import):
benchmarks/cli_startup.py times it."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import typer

ROOT = Path(__file__).resolve().parent.parent
HEAVY = ("torch", "ray", "mlflow", "torchvision")


def imported_after(statement: str) -> list[str]:
    code = f"import sys; {statement}; print(__import__('json').dumps([m for m in {HEAVY!r} if m in sys.modules]))"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_the_cli_and_the_config_import_no_heavy_module():
    assert imported_after("import pipelines.cli") == []
    assert imported_after("from mdc.config import load_config, DEFAULT_CONFIG; load_config(DEFAULT_CONFIG, [])") == []


def test_a_config_error_answers_without_heavy_modules():
    code = (
        "import sys\nfrom typer.testing import CliRunner\nfrom pipelines.cli import app\n"
        "r = CliRunner().invoke(app, ['train', 'train.stpes=3'])\n"
        "print(r.exit_code, [m for m in ('torch', 'ray', 'mlflow') if m in sys.modules])"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.strip().splitlines()[-1] == "2 []"


def test_the_deferred_commands_list_their_own_help():
    """The listing's short help of each deferred command is the one it shows once loaded."""
    from pipelines.cli import LAZY, load_command

    for name, (_, _, short) in LAZY.items():
        command = load_command(name)
        assert command.name == name
        assert (command.help or "").strip().splitlines()[0] == short, name


def test_every_command_runs_through_the_lazy_group():
    from typer.testing import CliRunner

    from pipelines.cli import app

    result = CliRunner().invoke(app, ["export", "--help"])
    assert result.exit_code == 0 and "--to" in result.output
    group = typer.main.get_command(app)
    assert {"train", "tune", "config", "data", "eval", "export"} <= set(group.list_commands(None))


def test_the_readme_lists_every_command():
    from pipelines.cli import app

    readme = (ROOT / "README.md").read_text()
    group = typer.main.get_command(app)
    missing = [name for name in group.list_commands(None) if f"| `mdc {name}` |" not in readme]
    assert missing == []
