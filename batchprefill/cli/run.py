"""`batchprefill-run`: run a job (pipeline.run) from the command line."""

from __future__ import annotations

from batchprefill.cli.app import console_script, hydra_app
from batchprefill.settings import JobSettings


def run(job: JobSettings) -> None:
    from batchprefill.pipeline.run import run_job  # after Hydra parsed the command line: --help stays fast

    run_job(job)


command = hydra_app("batchprefill", run)  # ends in SystemExit: callable in-process
main = console_script(command)  # the console script: ends the process when the command is done
