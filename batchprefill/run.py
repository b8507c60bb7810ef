"""`batchprefill-run`: the Hydra entry point of a job."""

from __future__ import annotations

import sys
from pathlib import Path

import hydra
from omegaconf import DictConfig

from batchprefill.errors import JobError

CONFIG_DIR = str(Path(__file__).resolve().parent / "conf")


@hydra.main(version_base="1.3", config_path=CONFIG_DIR, config_name="config")
def main(cfg: DictConfig) -> None:
    from batchprefill.job import run_job  # after Hydra parsed the command line: --help stays fast

    try:
        run_job(cfg)
    except JobError as error:
        print(f"batchprefill: error: {error}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
