"""`python -m tuner.cli`: the same app as the `tuner` script (allocation jobs run it this way)."""

from tuner.cli import app

app()
