"""`mdc` command line: the Typer commands, apart from the Ray programs they start (pipelines/commands/, pipelines/run/).
 Configs and inputs are checked before Ray starts; a user error is one line
and exit code 2, a run in which everything failed exit code 1."""

from __future__ import annotations

import typer

from pipelines.cli import runs
from pipelines.cli.config import config_app
from pipelines.cli.data import data_app
from pipelines.cli.evaluate import eval_app
from pipelines.cli.export import export_command
from pipelines.cli.schedule import schedule_command

app = typer.Typer(add_completion=False, no_args_is_help=True, help=__doc__)
app.add_typer(data_app, name="data")
app.add_typer(eval_app, name="eval")
app.add_typer(config_app, name="config")
EXTRA_ARGS = {"allow_extra_args": True, "ignore_unknown_options": True}  # `section.key=value` overrides
app.command(context_settings=EXTRA_ARGS)(runs.train)
app.command(context_settings=EXTRA_ARGS)(runs.tune)
app.command()(runs.demo)
app.command(context_settings=EXTRA_ARGS)(runs.compare)
app.command(context_settings=EXTRA_ARGS)(runs.scaling)
app.command()(runs.study)
app.command(context_settings=EXTRA_ARGS)(runs.submit)
app.command("export")(export_command)
app.command("schedule", context_settings=EXTRA_ARGS)(schedule_command)
