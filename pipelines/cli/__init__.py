"""`mdc` command line: the Typer commands, apart from the Ray programs they start (pipelines/commands/, pipelines/run/).
 Configs and inputs are checked before Ray starts; a user error is one line
and exit code 2, a run in which everything failed exit code 1."""

from __future__ import annotations

import importlib

import click
import typer
from typer.core import TyperGroup

from pipelines.cli import runs, schedule
from pipelines.cli.config import config_app

# Commands whose modules import torch (seconds): loaded when named, so that `mdc --help` and a
# config error answer at once (benchmarks/cli_startup.py). name: (module, attribute, short help).
LAZY = {
    "data": ("pipelines.cli.data", "data_app", "Write datasets as shards (local path or s3://)."),
    "eval": (
        "pipelines.cli.evaluate",
        "eval_app",
        "Judge a model: all (a whole eval section), probe, compositionality, captions, zeroshot, infill.",
    ),
    "export": (
        "pipelines.cli.export",
        "export_command",
        "Export a checkpoint's encoder for timm (and anyone without mdc).",
    ),
}


def load_command(name: str) -> click.Command:
    """The Click command of a LAZY entry, built as it would be had it been added to `app`."""
    module, attribute, _ = LAZY[name]
    target = getattr(importlib.import_module(module), attribute)
    holder = typer.Typer(add_completion=False)
    if isinstance(target, typer.Typer):
        holder.add_typer(target, name=name)
        return typer.main.get_group(holder).commands[name]
    holder.command(name)(target)
    command = typer.main.get_command(holder)  # one command: Typer gives it itself
    command.name = name
    return command


class LazyGroup(TyperGroup):
    """Lists the LAZY commands by their short help alone; imports one only when it runs."""

    def list_commands(self, ctx: click.Context) -> list[str]:
        return [*super().list_commands(ctx), *LAZY]

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        if cmd_name in LAZY and cmd_name not in self.commands:
            return click.Command(cmd_name, short_help=LAZY[cmd_name][2], help=LAZY[cmd_name][2])  # for the listing
        return super().get_command(ctx, cmd_name)

    def resolve_command(self, ctx: click.Context, args: list[str]):
        name, command, rest = super().resolve_command(ctx, args)
        if name in LAZY and name not in self.commands:
            self.commands[name] = command = load_command(name)
        return name, command, rest


app = typer.Typer(add_completion=False, no_args_is_help=True, help=__doc__, cls=LazyGroup)
app.add_typer(config_app, name="config")
EXTRA_ARGS = {"allow_extra_args": True, "ignore_unknown_options": True}  # `section.key=value` overrides
app.command(context_settings=EXTRA_ARGS)(runs.train)
app.command(context_settings=EXTRA_ARGS)(runs.tune)
app.command()(runs.demo)
app.command(context_settings=EXTRA_ARGS)(runs.compare)
app.command(context_settings=EXTRA_ARGS)(runs.scaling)
app.command()(runs.study)
app.command(context_settings=EXTRA_ARGS)(runs.submit)
app.command("schedule", context_settings=EXTRA_ARGS)(schedule.schedule_command)
