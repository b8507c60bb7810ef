"""`batchprefill-merge`: check and combine a Slurm array's shards (pipeline.merge) from the command line."""

from __future__ import annotations

import sys

from batchprefill.cli.app import console_script, hydra_app
from batchprefill.settings import JobSettings


def merge(job: JobSettings) -> None:
    from batchprefill.pipeline.merge import merge_shards

    print(merge_shards(job), file=sys.stderr)


command = hydra_app("batchprefill-merge", merge)  # ends in SystemExit: callable in-process
main = console_script(command)  # the console script: ends the process when the command is done
