"""The task scheduler: :class:`PromisingTasksFirst` spends the trials on the tasks that can win."""

from __future__ import annotations

import math
import time

from tvm.ir.utils import derived_object
from tvm.s_tir import meta_schedule as ms


@derived_object
class PromisingTasksFirst(ms.task_scheduler.PyTaskScheduler):
    """MetaSchedule task scheduler for tasks that are *alternatives* (each task one program of the
    same kernel, and only the fastest matters). TVM's "gradient" scheduler minimises the weighted
    *sum* of the tasks' latencies (a network's operators) and starts with a round of every task;
    round-robin spreads trials evenly. Here the tasks come in order of promise (``tune``: the ones
    holding the known configurations first, then the programs nearest to the defaults), at most
    ``explore`` of the batches go to tasks not tried yet, one batch each in that order, and the
    others to the tasks whose best is within ``near`` of the best so far (the fewest batches
    first); a task that measured slower than that gets no more trials."""

    def __init__(self, progress, batches: int, explore: float = 0.5, near: float = 1.1):
        super().__init__()
        self.progress, self.near = progress, near
        self.explore_batches = max(1, math.ceil(batches * explore))
        self.given: list[int] = []
        self.in_flight: set[int] = set()
        progress.on_join.append(self.in_flight.discard)

    def choose(self, alive: list[int]) -> int:
        best = self.progress.task_best
        unexplored = [i for i in alive if not self.given[i]]
        explored_batches = sum(1 for g in self.given if g)
        if unexplored and (explored_batches < self.explore_batches or not best):
            return unexplored[0]
        top = min(best.values(), default=math.inf)
        contenders = [i for i in alive if best.get(i, math.inf) <= self.near * top]
        if contenders:
            return min(contenders, key=lambda i: (self.given[i], i))
        return unexplored[0] if unexplored else min(alive, key=lambda i: (self.given[i], i))

    def next_task_id(self) -> int:
        scheduler = self._outer()
        records = scheduler.tasks_
        if not self.given:
            self.given = [0] * len(records)
        for i in range(len(records)):
            scheduler.touch_task(i)  # joins a task whose measurements have all come back
        while True:  # a task joined here may turn out exhausted: then choose again
            alive = [i for i in range(len(records)) if not records[i].is_terminated and i not in self.progress.exhausted]
            if not alive:
                return -1  # MetaSchedule joins the tasks still in flight
            task_id = self.choose(alive)
            if task_id not in self.in_flight:
                break
            scheduler.join_running_task(task_id)
            self.in_flight.discard(task_id)
            if task_id not in self.progress.exhausted:
                break
        self.in_flight.add(task_id)
        self.given[task_id] += 1
        # said before the search round, which takes seconds to a minute on a GPU task's space
        self.progress.echo(f"  searching task {self.progress.tasks[task_id]['name']} "
                           f"({time.perf_counter() - self.progress.start:.0f} s)")
        return task_id
