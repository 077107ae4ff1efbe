"""`mdc config show [--objective NAME]`: what each objective's config section holds, read from the
registry's config classes, one line a field (type, default, bounds, description)."""

from __future__ import annotations

from typing import Optional

import typer
from pydantic.fields import FieldInfo

from mdc import registry
from pipelines.infra.console import console, user_errors

config_app = typer.Typer(no_args_is_help=True, help="What a run config can hold.")
_BOUNDS = {"ge": ">=", "gt": ">", "le": "<=", "lt": "<"}


def field_line(name: str, field: FieldInfo) -> str:
    kind = getattr(field.annotation, "__name__", str(field.annotation))
    bounds = ", ".join(
        f"{sign} {getattr(m, key)}" for m in field.metadata for key, sign in _BOUNDS.items() if hasattr(m, key)
    )
    about = (f"({bounds}) " if bounds else "") + (f"— {field.description}" if field.description else "")
    return f"  objective.{name}: {kind} = {field.default!r} {about}".rstrip()


def objective_lines(name: str) -> list[str]:
    """The objective's summary, then its own fields (`name` apart)."""
    entry = registry.objective(name)
    fields = [field_line(key, field) for key, field in entry.config.model_fields.items() if key != "name"]
    return [f"objective.name={name}: {entry.summary}", *(fields or ["  (no fields of its own)"])]


@config_app.command("show")
def show(
    objective: Optional[str] = typer.Option(None, help=f"one of {', '.join(registry.OBJECTIVES)}; default: all"),
):
    """Each objective's config fields: type, default, bounds and what it is for."""
    with user_errors(ValueError):
        lines = [line for name in ([objective] if objective else registry.OBJECTIVES) for line in objective_lines(name)]
    for line in lines:
        console.print(line, markup=False, highlight=False)
