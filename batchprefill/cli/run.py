"""`batchprefill-run`: run a job (pipeline.run) from the command line."""

from __future__ import annotations

from batchprefill.cli.app import hydra_app
from batchprefill.settings import JobSettings


def run(job: JobSettings) -> None:
    from batchprefill.pipeline.run import run_job  # after Hydra parsed the command line: --help stays fast

    run_job(job)


main = hydra_app("batchprefill", run)
