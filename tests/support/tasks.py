"""What the tests observe of the Trio run they are in: its tasks, by name."""

from __future__ import annotations

import trio


def task_names() -> list[str]:
    """The names of every task of the current Trio run (the whole tree from its root)."""
    names, todo = [], [trio.lowlevel.current_root_task()]
    while todo:
        task = todo.pop()
        names.append(task.name)
        todo.extend(t for n in task.child_nurseries for t in n.child_tasks)
    return names


def worker_tasks() -> list[str]:
    """The names of the tasks that carry an engine worker's pipe (mlxd.engines.workers.worker_process)."""
    return sorted(n for n in task_names() if n.startswith("mlxd worker"))
