"""The exception type that ends a job: its message is the single line the user reads."""


class JobError(Exception):
    """A job-level fault the user must fix (bad input path, missing column, value out of range)."""

    exit_status = 2
