"""`mdc config show [SECTION] [--objective NAME]`: what each config section holds (each objective's
own fields for `objective`), read from the config classes, one line a field (type, default,
bounds, description): where a newcomer finds the setting to change."""

from __future__ import annotations

from typing import Literal, Optional, get_args, get_origin

import typer
from pydantic import BaseModel
from pydantic.fields import FieldInfo

from mdc.config import ConfigError, RunConfig
from mdc.objectives.sections import SECTIONS as OBJECTIVES  # the names, without torch
from pipelines.infra.console import console, user_errors

config_app = typer.Typer(no_args_is_help=True, help="What a run config can hold.")
_BOUNDS = {"ge": ">=", "gt": ">", "le": "<=", "lt": "<"}
SECTIONS = {
    name: field.annotation
    for name, field in RunConfig.model_fields.items()
    if isinstance(field.annotation, type) and issubclass(field.annotation, BaseModel)
}


def type_text(annotation) -> str:
    if get_origin(annotation) is Literal:
        return " | ".join(repr(value) for value in get_args(annotation))  # the allowed values
    item = item_model(annotation)
    if item is not None:
        return f"list of {item.__name__}"
    return getattr(annotation, "__name__", str(annotation)).replace("typing.", "")


def item_model(annotation) -> type[BaseModel] | None:
    """The model a list field holds (`list[ProbeSet] | None`: ProbeSet), or None."""
    for member in (annotation, *get_args(annotation)):
        if get_origin(member) is list:
            (item,) = get_args(member)
            if isinstance(item, type) and issubclass(item, BaseModel):
                return item
    return None


def field_lines(path: str, field: FieldInfo) -> list[str]:
    """A field's line; for a list of entries, also each entry field's (PATH[].KEY)."""
    item = item_model(field.annotation)
    lines = [field_line(path, field)]
    if item is not None:
        lines += [field_line(f"{path}[].{key}", f).replace("  ", "    ", 1) for key, f in item.model_fields.items()]
    return lines


def field_line(path: str, field: FieldInfo) -> str:
    kind = type_text(field.annotation)
    bounds = ", ".join(
        f"{sign} {getattr(m, key)}" for m in field.metadata for key, sign in _BOUNDS.items() if hasattr(m, key)
    )
    about = (f"({bounds}) " if bounds else "") + (f"— {field.description}" if field.description else "")
    default = "(required)" if field.is_required() else f"= {field.default!r}"
    return f"  {path}: {kind} {default} {about}".rstrip()


def objective_lines(name: str) -> list[str]:
    """The objective's summary, then its own fields (`name` apart)."""
    from mdc import registry  # the summaries sit beside the models: torch, only for this section

    entry = registry.objective(name)
    fields = [field_line(f"objective.{key}", f) for key, f in entry.config.model_fields.items() if key != "name"]
    return [f"objective.name={name}: {entry.summary}", *(fields or ["  (no fields of its own)"])]


def section_lines(section: str) -> list[str]:
    """The section's purpose (its class's docstring, first line), then its fields."""
    if section == "objective":
        return [line for name in OBJECTIVES for line in objective_lines(name)]
    if section not in SECTIONS:
        raise ConfigError(f"unknown config section {section!r}: one of {', '.join(['objective', *SECTIONS])}")
    cls = SECTIONS[section]
    about = (cls.__doc__ or "").strip().splitlines()[:1]
    return [
        f"{section}:" + (f" {about[0]}" if about else ""),
        *(line for k, f in cls.model_fields.items() for line in field_lines(f"{section}.{k}", f)),
    ]


@config_app.command("show")
def show(
    section: Optional[str] = typer.Argument(None, help="a config section (train, workers, ...); default: all"),
    objective: Optional[str] = typer.Option(None, help=f"one of {', '.join(OBJECTIVES)}: its own fields"),
):
    """Each config section's fields (an objective's own with --objective): type, default, bounds and
    what it is for."""
    with user_errors(ValueError):
        if objective:
            lines = objective_lines(objective)
        else:
            names = [section] if section else [*SECTIONS, "objective"]
            lines = [line for name in names for line in section_lines(name)]
    for line in lines:
        console.print(line, markup=False, highlight=False)
