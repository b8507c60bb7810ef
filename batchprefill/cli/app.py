"""What every console script shares: the Hydra configuration, and errors that end a command in one line.

A job-level fault (JobError) prints what to fix. Any other exception is a bug: it prints one line naming the
log file that holds its full traceback, so a user never reads a raw stack and a developer never loses one.
"""

from __future__ import annotations

import atexit
import functools
import os
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.errors import HydraException
from omegaconf import DictConfig
from omegaconf.errors import ConfigAttributeError, ConfigKeyError, OmegaConfBaseException

from batchprefill.config_keys import KEYS, unknown_key_message
from batchprefill.errors import DiskFull, JobError
from batchprefill.io.atomic import disk_full_message, is_disk_full
from batchprefill.settings import CONFIG_DIR, JobSettings

# sysexits' EX_SOFTWARE: a bug, told apart from a fault the user fixes (JobError, 2) and an incomplete merge (1).
BUG_EXIT_STATUS = 70
SHOWN_CHARS = 300  # of an unexpected error's message on the one line; the log holds all of it


def one_line(text: str) -> str:
    """A message as the single stderr line a command may print (pyarrow and Hydra messages span lines)."""
    return " ".join(text.split())


@contextmanager
def reported_errors(command: str, log_dir: Path | None = None) -> Iterator[None]:
    """Ends the command with one stderr line for any exception: a JobError (DiskFull among them) with its own message
    and exit status, a full disk wherever it was met with exit 2, anything else with the path of a log holding its
    traceback (in `log_dir`, else the temp folder, whichever has room) and exit 70.

    Any entry point can wrap its body in this, Hydra app or not (a `batchprefill-eval` on lm-eval's parser).
    """
    try:
        yield
    except KeyboardInterrupt:
        print(f"{command}: interrupted", file=sys.stderr)
        sys.exit(130)  # 128 + SIGINT, as a shell reports it
    except Exception as error:  # noqa: BLE001 - the one place every unforeseen error is turned into a report
        fault = user_fault(error, log_dir)
        if fault is not None:
            print(f"{command}: error: {one_line(str(fault))}", file=sys.stderr)
            sys.exit(fault.exit_status)
        log = _write_traceback(command, log_dir)
        summary = one_line(f"{type(error).__name__}: {error}")[:SHOWN_CHARS]
        print(f"{command}: error: unexpected {summary}; this is a bug, the full traceback is in {log}",
              file=sys.stderr)
        sys.exit(BUG_EXIT_STATUS)


def user_fault(error: Exception, log_dir: Path | None = None) -> JobError | None:
    """The fault the user fixes that `error` is, as a JobError whose message a command prints after `error: ` (and the
    Python API raises): a JobError itself; a full disk wherever it was met (a write no caller named: Hydra's log, a
    library's cache) as DiskFull, named by its file or else `log_dir`; None for anything else, a bug."""
    if isinstance(error, JobError):
        return error
    if is_disk_full(error):
        return DiskFull(disk_full_message(error, Path(getattr(error, "filename", None) or log_dir or ".")))
    return None


def _write_traceback(command: str, log_dir: Path | None) -> Path:
    """The current exception's traceback in a new file: in `log_dir` when it can be written, else in /tmp."""
    text = f"{time.strftime('%Y-%m-%d %H:%M:%S')} {' '.join(sys.argv)}\n\n{traceback.format_exc()}"
    for folder in ([log_dir] if log_dir else []) + [Path(tempfile.gettempdir())]:
        try:
            handle, name = tempfile.mkstemp(prefix=f"{command}-error-", suffix=".log", dir=folder)
        except OSError:
            continue
        try:
            with os.fdopen(handle, "w") as log:
                log.write(text)
        except OSError:  # a full disk: the next folder may have room
            Path(name).unlink(missing_ok=True)
            continue
        return Path(name)
    raise RuntimeError(f"no folder to write the traceback to:\n{text}")


def check_output_dir(path: Path) -> None:
    """`output.dir` can be created and written: found before anything runs, not after hours of tokenizing."""
    try:
        path.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=path, prefix=".write-check-"):
            pass
    except OSError as error:
        raise JobError(f"output.dir={path} cannot be {'written' if path.is_dir() else 'created'}: "
                       f"{unwritable_reason(path, error)}; choose a folder you can write") from error


def unwritable_reason(path: Path, error: OSError) -> str:
    """Why `path` cannot be made or written, in words: a file in the way, else the system's reason."""
    for ancestor in (path, *path.parents):
        if ancestor.exists():
            if not ancestor.is_dir():
                return f"{ancestor} is a file, not a folder"
            break
    return error.strerror or str(error)


def checked_job(cfg: DictConfig) -> JobSettings:
    """The settings a job runs on, from a composed config: checked (settings.py), with a writable output.dir.
    Every command and the Python API (batchprefill.api) start a job through this."""
    job = JobSettings.from_config(cfg)
    check_output_dir(job.output.dir)
    return job


def config_error(error: HydraException | OmegaConfBaseException) -> JobError:
    """A bad override or config key as the JobError a user reads. A key that is not in the config names the keys
    nearest to it (not OmegaConf's advice to add the typo with `+`); a value Hydra cannot merge into its key (a
    mapping for a list) says what the key takes; anything else is Hydra's message with OmegaConf's cause. The
    command line and the Python API compose alike."""
    cause = error.__cause__
    key = getattr(cause, "full_key", None)
    if isinstance(cause, ConfigAttributeError | ConfigKeyError) and key and key not in KEYS:
        return JobError(unknown_key_message(key))
    if isinstance(cause, OmegaConfBaseException) and key in KEYS:
        return JobError(f"{error}: {key} takes {KEYS[key].words()}")
    detail = f" {cause}" if isinstance(cause, OmegaConfBaseException) else ""
    return JobError(f"{error}{detail}")


def console_script(command: Callable[[], None]) -> Callable[[], None]:
    """`command` (a `hydra_app`, which ends in SystemExit and may be called in-process, as the tests do) as a
    console script's entry point, which ends the process the moment the command is done (`exit_without_teardown`)."""

    def main() -> None:
        with exit_without_teardown():
            command()

    return main


@contextmanager
def exit_without_teardown() -> Iterator[None]:
    """Ends a console script the moment its work is done, with the exit status it chose: the atexit handlers run
    (log files flushed, child processes reaped) and the output streams are flushed, but the interpreter is not torn
    down. Tearing it down frees every module's objects one by one, which no one needs at exit: after a finished
    job it took 0.65 s of a 3.4 s process on 2 cores (AMD EPYC; 0.37 s after `import torch` alone), and on a GPU it
    also frees the caching allocator's memory and the CUDA graphs block by block (benchmarks/gpu/process_clock.py
    times it there). The job has committed everything before it returns, so nothing is lost."""
    status: int | str | None = 0
    try:
        yield
    except SystemExit as stop:
        status = stop.code
    if isinstance(status, str):  # sys.exit("message"), as the interpreter reports it
        print(status, file=sys.stderr)
    atexit._run_exitfuncs()  # what the interpreter runs at exit, in the same order
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status if isinstance(status, int) else 0 if status is None else 1)


def hydra_app(command: str, task: Callable[[JobSettings], object]) -> Callable[[], None]:
    """A Hydra entry point on conf/config.yaml: the config is parsed once into JobSettings, which the task gets;
    any error ends it in one line (see `reported_errors`).

    Hydra's own errors (a bad override, an output.dir it cannot make its run folder in) come before the task:
    with HYDRA_FULL_ERROR set, Hydra raises them here instead of printing a stack, and they become JobErrors.
    """

    @functools.wraps(task)
    def run(cfg: DictConfig) -> None:
        with reported_errors(command, Path(HydraConfig.get().runtime.output_dir)):
            task(checked_job(cfg))

    hydra_main = hydra.main(version_base="1.3", config_path=CONFIG_DIR, config_name="config")(run)

    def main() -> None:
        os.environ["HYDRA_FULL_ERROR"] = "1"
        with reported_errors(command):
            try:
                hydra_main()
            except (HydraException, OmegaConfBaseException) as error:
                raise config_error(error) from error
            except OSError as error:  # Hydra writes its run folder (hydra.run.dir) under output.dir
                path = Path(error.filename or ".")
                if is_disk_full(error):
                    raise DiskFull(disk_full_message(error, Path(error.filename) if error.filename else None,
                                                     None if error.filename else "Hydra's run folder (hydra.run.dir, "
                                                     "under output.dir)")) from error
                raise JobError(f"{path} cannot be created or written: {unwritable_reason(path, error)}; choose an "
                               "output.dir you can write (Hydra's run folder, hydra.run.dir, is under it)") from error

    return main
