"""The one user-facing error type of the pipeline."""


class PipelineError(ValueError):
    """A user-facing error: the message names the field/file and what to do."""
