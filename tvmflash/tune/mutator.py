"""The search's mutator: :class:`MutateKnob` moves a candidate to another value of one knob."""

from __future__ import annotations

import random

from tvm.ir.utils import derived_object
from tvm.s_tir import meta_schedule as ms

from tvmflash.tune.space import structure_index


@derived_object
class MutateKnob(ms.mutator.PyMutator):
    """Mutate one knob: move a random sampled knob's SampleCategorical decision to another
    candidate, or (``retrace``, a task of several structures) move the candidate to another of the
    task's structures that differs in one structural knob, with the same sampled decisions. TVM's
    own mutators only mutate categorical decisions that feed an unroll annotation or a thread
    binding, and none changes a design space."""

    def __init__(self, seed: int = 0, structures_: list[dict] | None = None, retrace=None):
        self._rng = random.Random(seed)
        self.structures, self.retrace = structures_ or [{}], retrace

    def _initialize_with_tune_context(self, context) -> None:
        pass

    def apply(self, trace, _rand_state):
        choices = [inst for inst in trace.insts
                   if inst.kind.name == "SampleCategorical" and len(inst.attrs[0]) > 1]
        index = structure_index(trace, self.structures)
        current = self.structures[index]
        # the structure knobs some other structure of the task sets otherwise
        names = [n for n in current if any(s[n] != current[n] for s in self.structures)] if self.retrace else []
        # each knob equally likely: a structural one (names) or a sampled one (choices)
        pick = self._rng.randrange(len(names) + len(choices)) if names or choices else None
        if pick is None:
            return None
        if pick < len(names):
            # a structure with another value of this knob, and of the fewest others (a layout may
            # need another copy to go with it)
            name = names[pick]
            distance = {i: sum(s[n] != current[n] for n in current) for i, s in enumerate(self.structures)
                        if s[name] != current[name]}
            nearest = [i for i, d in distance.items() if d == min(distance.values())]
            return self.retrace(trace, self._rng.choice(nearest))
        inst = choices[pick - len(names)]
        old = int(trace.get_decision(inst))
        new = self._rng.choice([d for d in range(len(inst.attrs[0])) if d != old])
        return trace.with_decision(inst, new, remove_postproc=True)

    def clone(self):
        return MutateKnob(self._rng.randrange(2**31), self.structures, self.retrace)
