"""`batchprefill-plan`: the dry run (pipeline.plan) from the command line."""

from __future__ import annotations

from batchprefill.cli.app import console_script, hydra_app
from batchprefill.settings import JobSettings


def plan(job: JobSettings) -> None:
    from batchprefill.pipeline.plan import plan_job  # pulls in torch: after Hydra parsed the command line

    plan_job(job)


command = hydra_app("batchprefill", plan)  # ends in SystemExit: callable in-process
main = console_script(command)  # the console script: ends the process when the command is done
