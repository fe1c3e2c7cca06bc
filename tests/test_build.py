"""tvmflash's own steps in building a scheduled program (kernel.build_module)."""

import numpy as np
import tvm
from tvm.script import tirx as T

from tvmflash import kernel
from tvmflash.schedules.common import REVERSED


def test_a_loop_annotated_reversed_runs_last_to_first():
    """Each iteration records how many ran before it: reversed, iteration i is the (7 - i)-th."""

    @T.prim_func
    def visit_order(order: T.Buffer((8,), "int32"), count: T.Buffer((1,), "int32")):
        count[0] = 0
        for i in T.serial(8, annotations={REVERSED: 1}):
            order[i] = count[0]
            count[0] = count[0] + 1

    target = tvm.target.Target({"kind": "llvm"})
    run = kernel.build_module(tvm.IRModule({"main": visit_order}), target, {})
    order, count = (tvm.runtime.tensor(np.full(n, -1, "int32")) for n in (8, 1))
    run(order, count)
    assert order.numpy().tolist() == [7, 6, 5, 4, 3, 2, 1, 0]
    assert count.numpy().tolist() == [8]
