"""``tvmflash.tvmscript``: the programs' entry to TVMScript gives what ``T.prim_func`` gives, and raises what
its parser raises."""

from __future__ import annotations

import pytest
import tvm
from tvm.script import tirx as T

from tvmflash import tvmscript


def _by_tvm(n: int, dtype: str):
    @T.prim_func(s_tir=True)
    def main(a: T.handle):
        A = T.match_buffer(a, (n,), dtype)
        for i in range(n):
            with T.sblock("add"):
                vi = T.axis.spatial(n, i)
                A[vi] = A[vi] + T.cast(1, dtype)
    return main


def _by_tvmscript(n: int, dtype: str):
    @tvmscript.prim_func(s_tir=True)
    def main(a: T.handle):
        A = T.match_buffer(a, (n,), dtype)
        for i in range(n):
            with T.sblock("add"):
                vi = T.axis.spatial(n, i)
                A[vi] = A[vi] + T.cast(1, dtype)
    return main


def test_prim_func_is_t_prim_funcs():
    ours, tvms = _by_tvmscript(16, "float16"), _by_tvm(16, "float16")
    tvm.ir.assert_structural_equal(ours, tvms)
    assert ours.attrs["s_tir"] and ours.__name__ == "main"


def test_a_parse_error_is_raised_in_the_caller():
    with pytest.raises(tvm.error.DiagnosticError, match="Undefined variable"):
        @tvmscript.prim_func(s_tir=True)
        def main(a: T.handle):
            A = T.match_buffer(a, (4,), "float32")
            A[0] = undefined_name  # noqa: F821
