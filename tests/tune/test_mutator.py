"""The mutator (tvmflash/tune/mutator.py): the search explores the sampled knobs."""

import re

import tvm

from tvmflash import program, program_forward
from tvmflash.schedules import cpu
from tvmflash.tune.mutator import MutateKnob
from tvmflash.tune.space import decided_knobs, space_fn, task_knobs
from tvmflash.tune.task import specialize


def vector_widths(sch):
    return sorted({int(n) for n in re.findall(r"T.vectorized\((\d+)\)", sch.mod.script())})


def test_sampled_knob_is_replayed_and_mutated():
    """The evidence that the search explores the sampled knob: the trace refers to the decision
    (ExprRV), so replaying it with another decision, or MutateKnob's mutation, changes the schedule."""
    spec = program.AttentionSpec(32, "float32", False, 1, 1)
    func = specialize(program_forward.attention_forward(spec, 16, 32), spec, batch=1, seqlen_q=64, seqlen_k=64,
                           softmax_scale=0.2)
    mod = tvm.IRModule({"main": func})
    fixed, sampled = task_knobs({"block_m": [16], "block_n": [32], "vector": [4, 8, 16]}, 16, 32)
    sch = tvm.s_tir.Schedule(mod)
    space_fn(cpu.SCHEDULE, fixed, sampled)(sch)
    trace = sch.trace
    (inst,) = [i for i in trace.insts if i.kind.name == "SampleCategorical"]
    seen = {}
    for decision in range(3):
        replayed = tvm.s_tir.Schedule(mod)
        trace.with_decision(inst, decision, remove_postproc=True).apply_to_schedule(replayed, remove_postproc=True)
        seen[decision] = vector_widths(replayed)
        assert decided_knobs(replayed.trace, fixed, sampled)["vector"] == sampled["vector"][decision]
    assert seen == {0: [4], 1: [8], 2: [16]}

    mutated = MutateKnob(seed=1).apply(trace)
    (new_inst,) = [i for i in mutated.insts if i.kind.name == "SampleCategorical"]
    assert int(mutated.get_decision(new_inst)) != int(trace.get_decision(inst))
    again = tvm.s_tir.Schedule(mod)
    mutated.apply_to_schedule(again, remove_postproc=True)
    assert vector_widths(again) != vector_widths(sch)
