"""`batchprefill-merge`: check and combine a Slurm array's shards (pipeline.merge) from the command line."""

from __future__ import annotations

import sys

from batchprefill.cli.app import hydra_app
from batchprefill.settings import JobSettings


def merge(job: JobSettings) -> None:
    from batchprefill.pipeline.merge import merge_shards

    print(merge_shards(job), file=sys.stderr)


main = hydra_app("batchprefill-merge", merge)
