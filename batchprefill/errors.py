"""The exception type that ends a job: its message is the single line the user reads."""


class JobError(Exception):
    """A job-level fault the user must fix (bad input path, missing column, value out of range)."""

    exit_status = 2


class DiskFull(JobError):
    """A write found its file system full (ENOSPC) or the user's quota spent (EDQUOT): the user's to fix, not a
    bug. Whatever was committed before stays whole, so after space is freed a rerun resumes."""
