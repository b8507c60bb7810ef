"""A real single-node Slurm for the tests, and the few client calls they need.

`scripts/slurm-up.sh` starts it (installing Debian's packages when they are missing, as on a fresh CI machine)
and `scripts/slurm-down.sh` stops it, so the tests, CI and a developer trying `jobs/` by hand share one way
to run Slurm. Failing to start raises: the Slurm tests then fail, they never skip.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
TERMINAL = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "OUT_OF_MEMORY", "NODE_FAIL", "BOOT_FAIL", "DEADLINE",
            "PREEMPTED"}


class SlurmCluster:
    """One cluster whose config, state and logs live in `folder`; clients reach it through `env`."""

    def __init__(self, folder: Path):
        self.folder = folder
        # The interpreter's own bin folder first: jobs and tests call batchprefill-run through PATH, which must
        # find this environment's scripts even when its virtual environment is not activated.
        path = os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])
        self.env = {**os.environ, "SLURM_CONF": str(folder / "slurm.conf"), "PATH": path}

    @classmethod
    def start(cls, folder: Path) -> SlurmCluster:
        up = subprocess.run(["bash", str(REPO / "scripts" / "slurm-up.sh"), str(folder)], capture_output=True,
                            text=True, timeout=900)
        if up.returncode != 0:
            cls(folder).stop()  # a daemon that started before the failure
            raise RuntimeError(f"could not start Slurm (scripts/slurm-up.sh exit {up.returncode}):\n{up.stderr}")
        return cls(folder)

    def stop(self) -> None:
        subprocess.run(["bash", str(REPO / "scripts" / "slurm-down.sh"), str(self.folder)], timeout=120, check=False)

    def call(self, *args: str, cwd: Path | None = None) -> str:
        """A Slurm client command's stdout; raises with its stderr when it fails."""
        done = subprocess.run(list(args), env=self.env, cwd=cwd, capture_output=True, text=True, timeout=60)
        if done.returncode != 0:
            raise RuntimeError(f"{' '.join(args)} failed ({done.returncode}): {done.stderr.strip()}")
        return done.stdout

    def sbatch(self, *args: str, cwd: Path | None = None) -> str:
        return self.call("sbatch", "--parsable", *args, cwd=cwd).strip().split(";")[0]

    def states(self, job_id: str) -> dict[str, str]:
        """State per job or array task (`12`, `12_0`, pending tasks as `12_[1-2]`), finished ones included."""
        out = self.call("squeue", "-h", "-t", "all", "-j", job_id, "-o", "%i %T")
        return dict(line.split() for line in out.splitlines() if line.strip())

    def wait(self, job_ids: list[str], timeout: float) -> dict[str, str]:
        """Poll until every job (every task of an array) has ended; sbatch --wait polls too slowly."""
        deadline = time.monotonic() + timeout
        while True:
            states: dict[str, str] = {}
            for job_id in job_ids:
                states.update(self.states(job_id))
            if states and all(s in TERMINAL for s in states.values()):
                return states
            if time.monotonic() > deadline:
                raise TimeoutError(f"Slurm jobs still not done after {timeout:.0f} s: {states}")
            time.sleep(1)

    def show(self, job_id: str) -> dict[str, str]:
        """`scontrol show job` as key=value pairs (Restarts, ExitCode, JobState...)."""
        line = self.call("scontrol", "show", "job", "-o", job_id).splitlines()[0]
        return dict(item.split("=", 1) for item in line.split() if "=" in item)
