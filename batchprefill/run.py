"""`batchprefill-run`: the Hydra entry point of a job."""

from __future__ import annotations

from omegaconf import DictConfig

from batchprefill.cli import hydra_app


def run(cfg: DictConfig) -> None:
    from batchprefill.job import run_job  # after Hydra parsed the command line: --help stays fast

    run_job(cfg)


main = hydra_app("batchprefill", run)

if __name__ == "__main__":
    main()
