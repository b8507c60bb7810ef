"""`batchprefill-run`: the Hydra entry point of a job."""

from __future__ import annotations

from batchprefill.cli import hydra_app
from batchprefill.settings import JobSettings


def run(job: JobSettings) -> None:
    from batchprefill.job import run_job  # after Hydra parsed the command line: --help stays fast

    run_job(job)


main = hydra_app("batchprefill", run)

if __name__ == "__main__":
    main()
