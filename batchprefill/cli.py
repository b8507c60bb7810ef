"""What every console script shares: the Hydra configuration and one-line errors for job-level faults."""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable
from pathlib import Path

import hydra
from omegaconf import DictConfig

from batchprefill.errors import JobError
from batchprefill.settings import JobSettings

CONFIG_DIR = str(Path(__file__).resolve().parent / "conf")


def hydra_app(command: str, task: Callable[[JobSettings], object]) -> Callable[[], None]:
    """A Hydra entry point on conf/config.yaml: the config is parsed once into JobSettings, which the task gets;
    a JobError ends it with one line on stderr and its exit status."""

    @functools.wraps(task)
    def run(cfg: DictConfig) -> None:
        try:
            task(JobSettings.from_config(cfg))
        except JobError as error:
            print(f"{command}: error: {error}", file=sys.stderr)
            sys.exit(error.exit_status)

    return hydra.main(version_base="1.3", config_path=CONFIG_DIR, config_name="config")(run)
