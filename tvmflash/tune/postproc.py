"""The space's postprocessor: :class:`PreCheck` rejects a candidate before it is built."""

from __future__ import annotations

from tvm.ir.utils import derived_object
from tvm.s_tir import meta_schedule as ms

from tvmflash.tune.space import decided_knobs


@derived_object
class PreCheck(ms.postproc.PyPostproc):
    """MetaSchedule postprocessor: rejects (returns False for) a candidate whose knobs
    ``candidate_problem`` says cannot build or run, so that the search samples another before
    anything is built or measured. ``stats["rejected"]`` counts them (shared by the clones)."""

    def __init__(self, check, fixed: dict, sampled: dict, structures_: list[dict], stats: dict):
        self.check, self.fixed, self.sampled, self.structures, self.stats = check, fixed, sampled, structures_, stats

    def _initialize_with_tune_context(self, context) -> None:
        pass

    def apply(self, sch) -> bool:
        problem = self.check(decided_knobs(sch.trace, self.fixed, self.sampled, self.structures))
        if problem is not None:
            self.stats["rejected"] = self.stats.get("rejected", 0) + 1
        return problem is None

    def clone(self):
        return PreCheck(self.check, self.fixed, self.sampled, self.structures, self.stats)
