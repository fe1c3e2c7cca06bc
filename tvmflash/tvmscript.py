"""TVMScript's entries for tvmflash's programs and intrinsics: ``prim_func`` (a decorator, for
``T.prim_func``) and ``from_source`` (for ``tvm.script.from_source``). Each parses with TVM's own parser,
as TVM's entries do, but in a thread of its own, and reads none of the caller's stack.

Why: TVMScript reads the Python stack where it runs. ``T.prim_func`` calls ``inspect.stack()`` where it
decorates, and again where the parser evaluates the decorator to find the dialect; each ``T.macro`` call
walks the stack (``inspect.getouterframes``) to find its parser. Each of these reads the source line of
every frame, and a frame of code that is no module's file (pytest-xdist's ``<string>``, ``python -m``'s
``<frozen runpy>``) costs a scan of ``sys.modules`` (2000 modules once torch is in). Under pytest, or in a
training step, that is 40-80 ms a call: a third of a CPU build. The stack is kept, too, in reference
cycles, and with it the caller's frames and their tensors (a training step's activations) until the next
full collection. A thread's stack is its own frames only: the parser's and the program builder's.

``prim_func`` reads no stack where TVM's reads one for what our programs never do: a function defined in a
class body (``@I.ir_module``), and, under ``from __future__ import annotations``, an annotation that names
a local of an enclosing function that the function's body does not use (the parser then reports the name
as undefined). Our programs' annotations name T's types. The decorator is written ``tvmscript.prim_func``
in the source: the parser reads its ``s_tir`` (and ``private``) from there, as it reads ``T.prim_func``'s.
"""

from __future__ import annotations

import threading
from typing import Any, Callable

import tvm.script
from tvm.script.parser._core import parse, utils


def in_thread(function: Callable, *args, **kwargs) -> Any:
    """``function(*args, **kwargs)`` run in a new thread (whose stack is its own frames), waited for: its
    value, or its exception raised here."""
    outcome: dict[str, Any] = {}

    def run():
        try:
            outcome["value"] = function(*args, **kwargs)
        except BaseException as error:  # noqa: BLE001 - raised again in the caller's thread
            outcome["error"] = error

    thread = threading.Thread(target=run, name="tvmflash-tvmscript", daemon=True)
    thread.start()
    thread.join()
    if "error" in outcome:
        raise outcome.pop("error")
    return outcome["value"]


def _parsed(func: Callable, check_well_formed: bool):
    """``func`` parsed as TVM's ``T.prim_func`` decorator parses it (its globals and closure as the
    parser's variables), in a thread of its own."""
    parsed = in_thread(parse, func, utils.inspect_function_capture(func), check_well_formed=check_well_formed)
    parsed.__name__ = func.__name__  # as T.prim_func names it
    return parsed


def prim_func(*, s_tir: bool = False, private: bool = False, check_well_formed: bool = True) -> Callable:
    """``@tvmscript.prim_func(s_tir=True)``: ``@T.prim_func(s_tir=True)``'s PrimFunc, parsed in a thread
    of its own (the module docstring says why). s_tir and private are read by the parser from the
    decorator as written (keywords with constant values, as ``T.prim_func``'s)."""
    del s_tir, private  # the parser reads them from the source

    def decorator(func: Callable):
        return _parsed(func, check_well_formed)

    decorator.dispatch_token = "tirx"  # the dialect the parser takes the decorated function in, as T.prim_func's
    return decorator


def from_source(source: str):
    """``tvm.script.from_source(source)``, parsed in a thread of its own (the module docstring says why)."""
    return in_thread(tvm.script.from_source, source)
