"""How a job ends badly: a config mistake (exit 2) or a failed run (exit 1), told apart by exit
code so scripts and sweeps can react; and the curated cause a stage raises to become the latter."""


class ConfigError(Exception):
    """A config mistake found before any model is built: exit code 2, no MLflow run."""

    exit_code = 2


class RunFailed(Exception):
    """A stage failed mid-run; what was written so far is kept and the run is marked FAILED."""

    exit_code = 1

    def __init__(self, stage: str, cause: str):
        super().__init__(f"stage '{stage}' failed: {cause}")
        self.stage = stage
        self.cause = cause


class StageFailure(Exception):
    """Raised by a stage with a curated one-line cause; the original exception is chained."""

    def __init__(self, cause: str):
        super().__init__(cause)
        self.cause = cause


def short_cause(exc: BaseException) -> str:
    """Exception type and the first non-empty line of its message."""
    if isinstance(exc, StageFailure):
        return exc.cause
    first = next((line.strip() for line in str(exc).splitlines() if line.strip()), "")
    return f"{type(exc).__name__}: {first}" if first else type(exc).__name__
