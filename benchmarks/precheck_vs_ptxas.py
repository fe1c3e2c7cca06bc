"""The tuner's pre-check against nvcc: every configuration of the sm90 forward space at a head_dim,
built as the tuner builds it and compiled by nvcc for sm_90a (no GPU needed).

    python benchmarks/precheck_vs_ptxas.py 256 96 128 64 --jobs 2

For each head_dim: how many configurations the space holds, how many the pre-check
(``tune.space.candidate_problem``) accepts, and how many of those fail to schedule, build or compile
(ptxas included: "Insufficient registers" is only found there). Issue 23's goal is at most 10% of the
measured candidates failing; every failure here is a wasted trial on the GPU.
"""

from __future__ import annotations

import argparse
import itertools
import multiprocessing
import time
from concurrent.futures import ProcessPoolExecutor


def configurations(head_dim: int) -> list[tuple[dict, str | None]]:
    """(knobs, the pre-check's objection or None) for every configuration of the sm90 forward's space."""
    from tvmflash import schedules as registry
    from tvmflash import target as targets
    from tvmflash.tune import space

    sm90, target = registry.SCHEDULES["sm90"], targets.cuda_target("sm90")
    knobset = sm90.forward.knobs
    found = []
    for point in space.task_points(sm90, knobset.space()):
        options = space.structures(sm90, knobset.space(), point)
        fixed, sampled = space.task_knobs(knobset.space(), **point, structure_names=list(options[0]) if options else ())
        base = {**knobset.defaults(head_dim), **fixed}
        for structure in options or [{}]:
            for values in itertools.product(*sampled.values()):
                knobs = {**base, **structure, **dict(zip(sampled, values))}
                found.append((knobs, space.candidate_problem(knobset, target, head_dim, "bfloat16", knobs)))
    return found


def build(job: tuple[int, dict]) -> str | None:
    """Schedule, build (at the tuner's static shape) and compile with nvcc; the error, or None."""
    import tvm
    from tvm.support import nvcc

    from tvmflash import program
    from tvmflash import schedules as registry
    from tvmflash import target as targets
    from tvmflash.tune import builder, task

    head_dim, knobs = job
    sm90, target = registry.SCHEDULES["sm90"], targets.cuda_target("sm90")
    spec = program.AttentionSpec(head_dim, "bfloat16", False, 2, 2)
    try:
        func = task.specialize(registry.program_for(spec, sm90, knobs), spec, batch=1, seqlen_q=512, seqlen_k=512,
                               softmax_scale=0.1)
        sch = tvm.s_tir.Schedule(tvm.IRModule({"main": func}))
        sm90.forward.apply(sch, **knobs)
        source = builder.ms_build(sch.mod, target, None, **sm90.build_options("forward")).imports[0].inspect_source()
        with target:
            nvcc.compile_cuda(source, target_format="cubin", arch="sm_90a", compiler="nvcc")
    except Exception as err:  # noqa: BLE001 - any failure is the answer
        lines = [line.strip() for line in str(err).splitlines() if line.strip()]
        return f"{type(err).__name__}: {lines[-1] if lines else ''}"[:300]
    return None


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("head_dims", type=int, nargs="+")
    parser.add_argument("--jobs", type=int, default=multiprocessing.cpu_count())
    args = parser.parse_args(argv)
    failures = 0
    for head_dim in args.head_dims:
        found = configurations(head_dim)
        accepted = [knobs for knobs, problem in found if problem is None]
        start = time.perf_counter()
        with ProcessPoolExecutor(args.jobs, mp_context=multiprocessing.get_context("spawn")) as pool:
            errors = list(pool.map(build, [(head_dim, knobs) for knobs in accepted]))
        failed = [(knobs, error) for knobs, error in zip(accepted, errors) if error]
        failures += len(failed)
        print(f"d{head_dim}: {len(found)} configurations, the pre-check accepts {len(accepted)}, of which "
              f"{len(failed)} fail to build ({time.perf_counter() - start:.0f} s)", flush=True)
        for knobs, error in failed:
            print(f"  {knobs}: {error}")
    return 1 if failures else 0


if __name__ == "__main__":
    raise SystemExit(main())
