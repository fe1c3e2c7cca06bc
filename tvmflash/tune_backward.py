"""``tvmflash tune --pass backward``: the backward's knobs for this machine, by measuring its space.

The backward is three programs run as one call (delta; dkdv; dq by a pass of its own, or by
dkdv's fp32 atomics), and its knobs change which of them run as well as their tiles. MetaSchedule
measures one program's candidates, so the backward is not searched by it: its space is small
(sm90's ``BACKWARD_SPACE`` holds 128 configurations, sm80's a few hundred), and a budget of
trials covers much of it. The known configurations (the defaults and, unless ``cold``, the best
user and shipped records) come first, then a random sample of the rest; each is built, in
parallel processes (``bench.build_in_parallel``), as ``tvmflash.compile_backward`` builds it, then
timed whole on the tuning shape's tensors, one at a time (``tune.gpu_timing_lock``). The fastest
whose gradients pass flash-attn's rule is stored as a record of the workload's backward
(``kernel.backward_workload``: ``"pass": "backward"``), which ``compile_backward`` reads.
"""

from __future__ import annotations

import contextlib
import random
import time
from pathlib import Path

import torch

from tvmflash import bench, database, kernel, tune
from tvmflash import schedules as schedule_registry
from tvmflash import target as targets


def space_points(space: dict) -> list[dict]:
    """Every configuration of a space: a list of values a knob, or a callable of the knobs resolved
    before it that returns that list (e.g. sm80's dq_warps, from dq_block_m)."""
    points = [{}]
    for name, values in space.items():
        points = [{**point, name: value} for point in points
                  for value in (values(point) if callable(values) else values)]
    return points


def candidates(schedule, spec_args: dict, target, known: dict, trials: int, rng: random.Random,
               space: dict | None = None) -> tuple[list[tuple[str, dict]], list[str]]:
    """[(label, knobs)] to measure: the known configurations (label -> knobs), then configurations
    of ``space`` (default the schedule's ``BACKWARD_SPACE``) drawn at random, ``trials`` in all; and
    why the configurations left out could not run (shared memory: a BackwardKernel refuses them
    before building anything)."""
    defaults = kernel.backward_default_knobs(schedule, spec_args["head_dim"])
    chosen, problems = list(known.items()), []
    rest = []
    for point in space_points(space if space is not None else schedule.BACKWARD_SPACE):
        knobs = {**defaults, **point}
        if knobs in known.values():
            continue
        try:
            kernel.BackwardKernel(spec_args, target, knobs)
        except ValueError as err:
            problems.append(str(err))
            continue
        rest.append(knobs)
    rng.shuffle(rest)
    chosen += [(f"#{n}", knobs) for n, knobs in enumerate(rest[:max(0, trials - len(chosen))], 1)]
    return chosen, problems


def tune_backward(*, head_dim: int, dtype, causal: bool, target=None, trials: int = 64, batch: int | None = None,
                  seqlen: int | None = None, heads: int | None = None, space: dict | None = None,
                  seed: int | None = None, repeat: int = 10, cold: bool = False, jobs: int | None = None,
                  echo=print) -> dict:
    """Tune the backward's knobs (the schedule ``compile_backward`` picks, its ``BACKWARD_SPACE`` or
    ``space``) for one workload on this machine and store the fastest correct configuration.

    Tuned on (batch, seqlen, heads) query and key heads alike (default: bench's grid, as the
    forward's tuner); ``trials`` configurations in all, the known ones first. ``cold``: no records
    are read (the defaults are still timed, as the reference and the floor of what is stored).
    ``jobs``: build processes (default: the usable cores). Returns the new record with ``path``.
    """
    dtype, resolved, shape = tune.tuning_request(head_dim, dtype, causal, trials, target, batch, seqlen, heads)
    cuda = tune.require_gpu(resolved)
    schedule = schedule_registry.backward_for_target(resolved, dtype, head_dim)
    schedule_name = schedule_registry.name_of(schedule)
    spec_args = {"head_dim": head_dim, "dtype": dtype, "causal": causal}
    workload = kernel.backward_workload(spec_args)
    start = time.perf_counter()
    echo(f"tvmflash tune --pass backward: {schedule_name} schedule on {targets.describe(resolved)}, d{head_dim} "
         f"{dtype} {'causal' if causal else 'full'}, shape b{shape['batch']} s{shape['seqlen']} h{shape['heads']}, "
         f"{trials} trials")

    defaults = kernel.backward_default_knobs(schedule, head_dim)
    known = {"default": defaults}
    if not cold:
        for record in database.known_records(resolved, schedule_name, workload, shape["seqlen"]):
            knobs = {**defaults, **record["knobs"]}
            if knobs not in known.values():
                known["user" if Path(record["source"]).parent == database.user_dir() else "shipped"] = knobs
    chosen, problems = candidates(schedule, spec_args, resolved, known, trials, random.Random(seed), space)
    echo(f"  measuring {len(chosen)} configurations ({', '.join(known)} first); {len(problems)} of the space "
         f"left out before building" + (f", e.g. {problems[0]}" if problems else ""))

    # ---- build, every core at once (a GPU backward module takes about half a minute, on one core)
    builds = [("compile_backward", {**spec_args, "target": resolved, "knobs": knobs,
                                    "heads_q": shape["heads"], "heads_kv": shape["heads"]}) for _, knobs in chosen]
    echo(f"  building {len(builds)} candidates, {tune.usable_cores() if jobs is None else jobs} at a time")
    errors = bench.build_in_parallel(builds, jobs or tune.usable_cores(), echo=lambda line: None, keep_going=True)
    echo(f"  built {sum(e is None for e in errors)}/{len(builds)} ({sum(e is not None for e in errors)} failed), "
         f"{time.perf_counter() - start:.0f} s")

    # ---- check and time each on the same tensors, in this process
    device = torch.device("cuda" if cuda else "cpu")
    gen = torch.Generator().manual_seed(0)
    q, k, v, dout = (torch.randn(shape["batch"], shape["seqlen"], shape["heads"], head_dim, generator=gen)
                     .to(device=device, dtype=kernel.TORCH_DTYPES[dtype]) for _ in range(4))
    out, lse = kernel.compile(head_dim=head_dim, dtype=dtype, causal=causal, target=resolved)(q, k, v, return_lse=True)
    times, failed = {}, 0
    for n, ((label, knobs), error) in enumerate(zip(chosen, errors), 1):
        what = label if label in known else f"{label} {({name: knobs[name] for name in knobs if knobs[name] != defaults.get(name)})}"
        if error is None:
            kern = kernel.compile_backward(**spec_args, target=resolved, knobs=knobs)
            grads = kern(q, k, v, out, dout, lse)
            wrong = [(name, err, allowed) for name, (err, allowed)
                     in zip(("dq", "dk", "dv"), bench.gradient_errors_vs_float32(grads, q, k, v, dout, causal))
                     if not err <= allowed]
            if wrong:
                error = "wrong gradients: " + ", ".join(f"{name} error {err:.2e} > {allowed:.2e}" for name, err, allowed in wrong)
        if error is not None:
            failed += 1
            echo(f"  trial {n}/{len(chosen)} {what}: failed ({error})")
            continue
        with tune.gpu_timing_lock() if cuda else contextlib.nullcontext():
            times[label] = bench.time_ms(lambda kern=kern: kern(q, k, v, out, dout, lse), device, repeat=repeat)
        best = min(times.values())
        echo(f"  trial {n}/{len(chosen)} {what}: {times[label]:.4f} ms (best {best:.4f} ms, "
             f"{time.perf_counter() - start:.0f} s)")
    if "default" not in times:
        raise RuntimeError("tvmflash tune --pass backward: the default knobs failed at the tuning shape")
    winner = min(times, key=times.get)
    searched = [label for label in times if label not in known]
    tuned = min(searched, key=times.get) if searched else "default"
    knobs = dict(chosen)[winner]
    wall_s = time.perf_counter() - start
    record = database.new_record(
        resolved, schedule_name, workload, knobs, times[winner],
        shape={"batch": shape["batch"], "seqlen_q": shape["seqlen"], "seqlen_k": shape["seqlen"],
               "heads_q": shape["heads"], "heads_kv": shape["heads"]},
        trials=len(chosen), failed_trials=failed, wall_s=round(wall_s, 1), default_ms=times["default"],
        tuned_ms=times[tuned], tuned_knobs=dict(chosen)[tuned], known_ms={label: times.get(label) for label in known},
        start="cold" if cold else "warm")
    path = database.add(record)
    kernel.forget_kernels()  # compile_backward must see the new record
    kept = next((r for r in database.read(path) if database.same_key(r, record)), record)
    echo(f"backward at b{shape['batch']} s{shape['seqlen']} h{shape['heads']}: default {times['default']:.4f} ms, "
         f"best {times[winner]:.4f} ms ({times['default'] / times[winner]:.2f}x, {winner}): {knobs}")
    if kept != record:
        echo(f"kept the faster record already in {path} ({kept['mean_ms']:.4f} ms at {kept.get('shape')}): {kept['knobs']}")
    else:
        echo(f"stored it in {path} ({len(chosen)} trials, {failed} failed, {wall_s:.0f} s)")
    return {**record, "path": str(path)}
