"""Command-line tools that work on a finished run's files: `python -m pipeline.tools.<name>`."""
