"""`batchprefill-plan`: the dry run (pipeline.plan) from the command line."""

from __future__ import annotations

from batchprefill.cli.app import hydra_app
from batchprefill.settings import JobSettings


def plan(job: JobSettings) -> None:
    from batchprefill.pipeline.plan import plan_job  # pulls in torch: after Hydra parsed the command line

    plan_job(job)


main = hydra_app("batchprefill", plan)
