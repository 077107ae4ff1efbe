from pipelines.cli import app

app()
