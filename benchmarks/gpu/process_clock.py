"""`python -m batchprefill.run` with a clock on the process around the job: where the whole process's time goes.

    python benchmarks/gpu/process_clock.py TIMES.json data.input=... output.dir=...   # the job's own arguments

On an H200 the 1B job's whole process took 21.3 s while the job itself (stats/job.parquet's wall_seconds) took 8.3:
this says where the other 13 s go. TIMES.json gets wall-clock instants (time.time()) for: this script's first line,
`import torch` done, `import batchprefill.cli.run` done, `import batchprefill.pipeline.run` done (the command imports
it after Hydra parsed its arguments; here before, so it is timed alone), the job entered and returned, and the
interpreter's exit beginning (atexit). The caller adds its own instants around the process (spawn and reaped), so
interpreter start-up and the teardown after atexit (CUDA's context, the caching allocator's memory) show too.
"""

from __future__ import annotations

import atexit
import json
import sys
import time
from pathlib import Path

marks = {"script": time.time()}
out = sys.argv.pop(1)
atexit.register(lambda: Path(out).write_text(json.dumps(marks | {"atexit": time.time()})))

import torch  # noqa: E402,F401 - timed: with CUDA its libraries are most of the imports

marks["torch_imported"] = time.time()
from batchprefill.cli import run as command  # noqa: E402

marks["cli_imported"] = time.time()
import batchprefill.pipeline.run as pipeline  # noqa: E402

marks["pipeline_imported"] = time.time()
job = pipeline.run_job


def timed_job(*args, **kwargs):
    marks["job_entered"] = time.time()
    try:
        return job(*args, **kwargs)
    finally:
        marks["job_returned"] = time.time()


pipeline.run_job = timed_job  # the command's deferred `from batchprefill.pipeline.run import run_job` finds this
sys.argv[0] = "batchprefill-run"
command.main()
