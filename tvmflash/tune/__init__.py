"""``tvmflash tune``: MetaSchedule search over the space of a schedule's forward knobs (its ``KnobSet``,
``schedules.contract``); the best knobs go to the database.

Laid out as MetaSchedule is, a file a role (one extension class each), imports running down the list:

- ``measured.py``: the backward's, decode's (over an FP8 cache too), the FP8 forward's and a flex workload's
  forward spaces, measured whole rather than searched (``tune_pass``, ``tvmflash tune --pass backward|decode``,
  ``--dtype float8_e4m3fn``, ``--cache-dtype float8_e4m3fn``, ``--flex NAME``);
- ``run.py``: the driver, ``tune``, and the tuning request (shape, known configurations) that
  ``measured.py`` shares;
- ``task.py``: the tasks, one TuneContext a program, and the seeds committed into MetaSchedule's database;
- ``task_scheduler.py``: ``PromisingTasksFirst``, which spends the trials on the tasks that can win;
- ``builder.py``, ``runner.py``: MetaSchedule's, reporting as they go; Kernel's build in the
  builder's workers, one process's GPU timings at a time in the runner's;
- ``progress.py``: the live status (``Reporter``) and the measure callback (``Progress``);
- ``mutator.py``: ``MutateKnob``; ``postproc.py``: ``PreCheck``;
- ``space.py``: the design space (tasks, structures, sampled decisions, seed traces, what cannot
  build), read from the schedule's contract: its knobs' roles, defaults, space and rules;
- ``decision.py``: whether a run's best replaces the incumbent (beyond the noise of repeated timings).

The schedule is the one ``tvmflash.compile`` takes (``choice.choose_schedule``), and the tuner
names it in every build it asks of the kernels (``schedule=``): a schedule is read through its
``Schedule`` alone, never through a module's attributes.

Design space (docs/design.md, "Tuning"). A MetaSchedule task is one TensorIR program: only the
knobs that change the program are tasks (``task_points``: the ``TILE`` knobs, ``block_m`` and
``block_n``, which shape its buffers and loops, and the ``PROGRAM`` knobs, such as sm90's
``min_blocks_per_sm``, a function attribute). Inside a task, each combination of the ``STRUCTURE``
knobs (plain Python values that change which schedule steps run: layouts, copies, stage counts)
that the knob set's ``rules`` accept is a design space of its own (``structures``), and every other
knob with more than one candidate is a ``sch.sample_categorical`` decision handed to the
schedule's ``apply(sch, **knobs)`` as the ExprRV itself
(split factors take ExprRVs). The trace then *refers* to the decision, so replaying it with
another decision gives another schedule; reading the value with ``sch.get(rv)`` would bake the
first sample into the trace as a constant. TVM's own mutators only mutate categorical decisions
that feed an unroll annotation or a thread binding, so ``MutateKnob`` mutates ours and moves
candidates between structures. ``PreCheck`` (a postprocessor) rejects candidates that cannot
build before they are built; ``PromisingTasksFirst`` spends the trials on tasks that can win.

Tune static, run symbolic. Each task's program is specialised to a representative shape (batch,
sequence lengths, softmax_scale), tuned with the XGBoost cost model and the evolutionary search,
and built exactly as :class:`tvmflash.Kernel` builds (``lowering.build``: the schedule's
PassContext config and the TVM workarounds). MetaSchedule's few fastest configurations
(``recheck``) are then built as ``tvmflash.compile`` builds them (symbolic shapes, which may rank
tiles differently) and timed with the default knobs on real torch tensors in the same run; the
fastest whose output passes flash-attn's error rule there (``bench.error_vs_float32``) is written
to tvmflash's database, where ``tvmflash.compile()`` finds it.

A structure or task that ``candidate_problem`` rejects (the knob set's ``KnobSet.problem``, shared
memory over the target's limit) is left out before anything is built, counted by reason in one line
(``progress.left_out_line``; each named in the work dir's ``left_out.txt``); candidates
that still fail to schedule, build or run are recorded by MetaSchedule as failed measurements and
never picked.

Warm start (the default): the known configurations (the defaults, the best user and shipped records)
seed MetaSchedule's database, where the evolutionary search takes its initial population from, and
are timed again with the search's best, so the stored record is never slower than they are. A record
replaces the incumbent (the knobs ``tvmflash.compile`` takes now) only where it beats it by more
than the noise of repeated timings (``decision.py``). ``cold`` hides them. Progress (``Reporter``)
is reported from the first build on, each build batch and each measurement as it comes, through
MetaSchedule's extension points: a builder, a runner and a measure callback of our own.
"""

from tvmflash.tune.measured import tune_pass
from tvmflash.tune.run import tune

__all__ = ["tune", "tune_pass"]
