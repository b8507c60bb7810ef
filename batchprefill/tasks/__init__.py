"""Every task a job can run, by its `task=` name (the interface is tasks/base.py).

Adding a task means adding a module beside this one whose class does what `Task` says, and listing it here.
"""

from __future__ import annotations

from batchprefill.errors import JobError
from batchprefill.tasks.base import Task
from batchprefill.tasks.classify import Classify
from batchprefill.tasks.embed import Embed
from batchprefill.tasks.generate import Generate
from batchprefill.tasks.score import Score

TASKS: dict[str, Task] = {task.name: task for task in (Generate(), Score(), Embed(), Classify())}


def get_task(name: str) -> Task:
    """The task of this name; a one-line JobError listing the others for a name no task has."""
    if name not in TASKS:
        names = list(TASKS)
        raise JobError(f"task={name!r}: choose {', '.join(names[:-1])} or {names[-1]}")
    return TASKS[name]
