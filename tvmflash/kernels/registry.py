"""The kernels that torch.compile'd graphs name, and the hooks that the floor above fills in.

Under torch.compile a kernel's call goes through torch custom ops, which call the kernel back by its
key at run time. Those ops live in ``tvmflash.ops`` (the top floor); a kernel never imports upward,
so ops.py registers its routes here when it is imported (``tvmflash``'s API imports it first).
"""

from __future__ import annotations

from typing import Callable

_BY_KEY: dict = {}  # the kernel of each key a torch.compile'd graph may name (never emptied)
_ROUTES: dict[str, Callable] = {}  # "forward", "varlen": how a call of that kernel is traced (ops.py's)
_FORGET: list[Callable] = []  # what empties the caches of kernels above this floor (``forget``)


def remember(kernel) -> None:
    """Keep ``kernel`` under its ``key`` for the custom ops to find (``by_key``)."""
    _BY_KEY[kernel.key] = kernel


def by_key(key: str):
    """The kernel a custom op's ``kernel`` argument names (its ``key``)."""
    return _BY_KEY[key]


def add_route(name: str, route: Callable) -> None:
    """ops.py's: ``route(kernel, *arguments)`` calls a kernel of ``name`` through its custom ops."""
    _ROUTES[name] = route


def route(name: str) -> Callable:
    """The custom-op route of a kernel's call under torch.compile (``add_route``)."""
    found = _ROUTES.get(name)
    if found is None:
        raise RuntimeError("a tvmflash kernel called under torch.compile needs tvmflash.ops imported (tvmflash.compile "
                           "imports it; tvmflash.kernels alone does not)")
    return found


def on_forget(forget: Callable[[], None]) -> None:
    """Run ``forget()`` whenever ``forget_kernels`` drops the kernels (a cache above this floor)."""
    _FORGET.append(forget)


def forget() -> None:
    for forget_one in _FORGET:
        forget_one()
