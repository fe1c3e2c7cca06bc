"""The task scheduler (tvmflash/tune/task_scheduler.py): the trials go to the tasks that can win."""

from tvmflash.tune.progress import Progress
from tvmflash.tune.task_scheduler import PromisingTasksFirst


def test_trials_go_to_the_tasks_that_can_win():
    """PromisingTasksFirst: tasks are alternatives, so after the exploring share of the batches (one
    each, in order of promise) the trials go to the tasks within 10% of the best, never round-robin
    to one that measured slower or was not tried."""
    progress = Progress([{"name": str(i)} for i in range(4)], 24, lambda line: None)
    scheduler = PromisingTasksFirst(progress, batches=6)  # 3 batches to explore
    scheduler.given = [0, 0, 0, 0]
    picks = []
    for best in ({}, {0: 1.0}, {0: 1.0, 1: 2.0}, {0: 1.0, 1: 2.0, 2: 1.05}, None, None, None):
        progress.task_best.update(best or {})
        task_id = scheduler.choose([0, 1, 2, 3])
        scheduler.given[task_id] += 1
        picks.append(task_id)
    assert picks == [0, 1, 2, 0, 2, 0, 2]
    assert scheduler.choose([1, 3]) == 3  # the near-best tasks are done: the untried one next
