"""Tracing a FlexAttention ``score_mod(score, b, h, q_idx, kv_idx)`` or ``mask_mod(b, h, q_idx, kv_idx)``:
the user's Python function runs once on symbolic values (``Traced``), and what it computes comes back
as a ``program_flex.Node`` tree, with the tensors it read from (its captures).

What a function may do with traced values: arithmetic (+ - * / // %, unary -), comparisons, & | ^ ~,
``torch.where``, ``tanh``, ``exp``, ``log``, ``abs``, ``sqrt``, ``sigmoid``, ``torch.minimum`` /
``maximum`` / ``clamp``, ``.to(dtype)`` and friends, and indexing a captured tensor with them
(``slopes[h]``, ``bias[h, q_idx - kv_idx + n]``, ``doc[q_idx]``). Python numbers mix in as constants.
Anything else (another torch function, an unknown method, Python control flow on a traced value:
``if``, ``and``/``or``, ``int()``, a Python list indexed by one) raises ``FlexTraceError``, which names
the operation and the line of the user's function that asked for it.
"""

from __future__ import annotations

import inspect
import math
import operator
import types
import weakref

import torch

from tvmflash import program_flex
from tvmflash.program_flex import FLOAT, INT32, INT64, BOOL, FlexMods, Node, make

# torch dtypes a traced value may be converted to (``.to``), by the value dtype they give
_CONVERSIONS = {torch.float32: FLOAT, torch.float16: FLOAT, torch.bfloat16: FLOAT, torch.float64: FLOAT,
                torch.int32: INT32, torch.int64: INT64, torch.int16: INT32, torch.int8: INT32, torch.uint8: INT32,
                torch.bool: BOOL}


class FlexTraceError(TypeError):
    """A score_mod or mask_mod did something the kernels cannot compile: the message names the operation
    and the line of the user's function."""


class _Tracing:
    """The state of one trace: the user's function (for error lines) and the captured tensors met."""

    def __init__(self, fn, what: str):
        self.fn, self.what = fn, what
        self.captures: list[torch.Tensor] = []

    def capture(self, tensor: torch.Tensor) -> int:
        for n, seen in enumerate(self.captures):
            if seen is tensor:
                return n
        self.captures.append(tensor)
        return len(self.captures) - 1

    def where_in_user_code(self) -> str:
        """'file:line' of the innermost frame of the user's code (not tvmflash's or torch's)."""
        if torch.compiler.is_compiling():  # Dynamo traces no frame inspection; its error names the line
            return f"{getattr(self.fn, '__name__', 'the function')} (traced by torch.compile)"
        code = getattr(self.fn, "__code__", None)
        frame = inspect.currentframe()
        fallback = None
        while frame is not None:
            if code is not None and frame.f_code is code:
                return f"{frame.f_code.co_filename}:{frame.f_lineno}"
            name = frame.f_code.co_filename
            if fallback is None and not (name == __file__ or "/torch/" in name):
                fallback = f"{name}:{frame.f_lineno}"
            frame = frame.f_back
        return fallback or "<unknown>"

    def error(self, operation: str, hint: str = "") -> FlexTraceError:
        return FlexTraceError(f"{self.what}: {operation} is not supported at {self.where_in_user_code()}"
                              + (f" ({hint})" if hint else ""))


def _unwrap(value, tracing: _Tracing):
    """A Node for a traced value or a Python number; an error for anything else (a tensor that is no
    index, a string)."""
    if isinstance(value, Traced):
        return value.node
    if isinstance(value, (torch.SymInt, torch.SymFloat, torch.SymBool)):
        raise tracing.error("a number that torch.compile made symbolic (it changed from call to call)",
                            "compile with dynamic=False, which compiles a graph for each value, or keep it fixed")
    if isinstance(value, (bool, int, float)):
        if isinstance(value, float) and math.isnan(value):
            raise tracing.error("a NaN constant")
        return program_flex.const(value)
    if isinstance(value, torch.Tensor) and value.dim() == 0:
        raise tracing.error("a 0-dim tensor operand", "pass a Python number, or index a captured tensor")
    raise tracing.error(f"an operand of type {type(value).__name__}")


def _make(tracing: _Tracing, op: str, *operands) -> Node:
    """``program_flex.make``, its TypeError (an operation on the wrong dtypes) as a ``FlexTraceError``
    that names the line."""
    try:
        return make(op, *operands)
    except TypeError as err:
        raise tracing.error(f"{op} of {[getattr(o, 'dtype', o) for o in operands]}", str(err)) from None


def _binary(op: str, reverse: bool = False):
    def method(self, other):
        a, b = self.node, _unwrap(other, self.tracing)
        return self._wrap(_make(self.tracing, op, *((b, a) if reverse else (a, b))))
    return method


def _refuse(operation: str, hint: str):
    def method(self, *args, **kwargs):
        raise self.tracing.error(operation, hint)
    return method


_CONTROL_FLOW = "Python control flow on a traced value; use torch.where, & and |"


class Traced:
    """A symbolic value of a traced score_mod or mask_mod (a ``program_flex.Node``). It acts as a 0-dim
    torch tensor would in the operations the module docstring lists."""

    __slots__ = ("node", "tracing")

    def __init__(self, node: Node, tracing: _Tracing):
        self.node, self.tracing = node, tracing

    def _wrap(self, node: Node) -> "Traced":
        return Traced(node, self.tracing)

    def __repr__(self) -> str:
        return f"<traced {self.node.dtype} {self.node.op}>"

    __add__, __radd__ = _binary("add"), _binary("add", True)
    __sub__, __rsub__ = _binary("sub"), _binary("sub", True)
    __mul__, __rmul__ = _binary("mul"), _binary("mul", True)
    __truediv__, __rtruediv__ = _binary("div"), _binary("div", True)
    __floordiv__, __rfloordiv__ = _binary("floordiv"), _binary("floordiv", True)
    __mod__, __rmod__ = _binary("mod"), _binary("mod", True)
    __and__, __rand__ = _binary("and"), _binary("and", True)
    __or__, __ror__ = _binary("or"), _binary("or", True)
    __xor__, __rxor__ = _binary("xor"), _binary("xor", True)
    __lt__, __le__, __gt__, __ge__ = _binary("lt"), _binary("le"), _binary("gt"), _binary("ge")
    __eq__, __ne__ = _binary("eq"), _binary("ne")
    __hash__ = None

    def __neg__(self):
        return self._wrap(_make(self.tracing, "neg", self.node))

    def __pos__(self):
        return self

    def __invert__(self):
        return self._wrap(_make(self.tracing, "not", self.node))

    def __abs__(self):
        return self._wrap(make("abs", self.node))

    def __pow__(self, exponent):
        # a small whole exponent is products; anything else has no rule here
        if isinstance(exponent, int) and not isinstance(exponent, bool) and 1 <= exponent <= 4:
            node = self.node
            for _ in range(exponent - 1):
                node = make("mul", node, self.node)
            return self._wrap(node)
        raise self.tracing.error(f"** {exponent!r}", "only whole exponents 1 to 4")

    __bool__ = _refuse("bool() of a traced value", _CONTROL_FLOW)
    __int__ = _refuse("int() of a traced value", _CONTROL_FLOW)
    __float__ = _refuse("float() of a traced value", _CONTROL_FLOW)
    __index__ = _refuse("using a traced value as a Python index", "index a captured torch tensor instead")
    __iter__ = _refuse("iterating over a traced value", _CONTROL_FLOW)
    __len__ = _refuse("len() of a traced value", _CONTROL_FLOW)
    __getitem__ = _refuse("indexing a traced value", "it is a scalar")
    __setitem__ = _refuse("assigning into a traced value", "the mods are pure functions")

    # tensor methods
    def tanh(self):
        return self._wrap(make("tanh", self.node))

    def exp(self):
        return self._wrap(make("exp", self.node))

    def log(self):
        return self._wrap(make("log", self.node))

    def sqrt(self):
        return self._wrap(make("sqrt", self.node))

    def sigmoid(self):
        return self._wrap(make("sigmoid", self.node))

    def abs(self):
        return self._wrap(make("abs", self.node))

    def clamp(self, min=None, max=None):  # noqa: A002 - torch's names
        return _clamp(self, min, max)

    clip = clamp

    def to(self, *args, **kwargs):
        dtype = kwargs.get("dtype", next((a for a in args if isinstance(a, torch.dtype)), None))
        if dtype is None:  # .to(device): the value stays where the kernel is
            return self
        if dtype not in _CONVERSIONS:
            raise self.tracing.error(f".to({dtype})")
        return self._wrap(program_flex.cast(self.node, _CONVERSIONS[dtype]))

    def float(self):
        return self._wrap(program_flex.cast(self.node, FLOAT))

    def int(self):
        return self._wrap(program_flex.cast(self.node, INT32))

    def long(self):
        return self._wrap(program_flex.cast(self.node, INT64))

    def bool(self):
        return self._wrap(program_flex.cast(self.node, BOOL))

    def logical_not(self):
        return self._wrap(make("not", program_flex.cast(self.node, BOOL)))

    def __getattr__(self, name):
        if name.startswith("__") and name.endswith("__"):
            # a protocol probe (hasattr(x, "__dict__"): Dynamo's, copy's) expects AttributeError, not a refusal
            raise AttributeError(name)
        raise self.tracing.error(f"the method or attribute .{name}")

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        tracing = next(a.tracing for a in _flatten((args, kwargs)) if isinstance(a, Traced))
        handler = _TORCH_FUNCTIONS.get(func)
        if handler is None:
            if getattr(func, "__name__", None) == "__getitem__":
                return _index(tracing, *args)
            raise tracing.error(_torch_name(func))
        return handler(tracing, *args, **kwargs)


def _torch_name(func) -> str:
    """How a user wrote ``func``: torch.sin, Tensor.sin (a method, or an operator on a tensor)."""
    name = getattr(func, "__name__", None)
    if name is None:
        return repr(func)
    if torch.compiler.is_compiling():  # (Dynamo traces no str method on a torch function's qualname)
        return f"torch.{name}"
    qualname = getattr(func, "__qualname__", "") or ""
    if qualname.startswith(("Tensor.", "TensorBase.")) or "TensorBase" in repr(func):
        return f"Tensor.{name}"
    return f"torch.{name}"


def _flatten(value):
    if isinstance(value, (list, tuple)):
        for v in value:
            yield from _flatten(v)
    elif isinstance(value, dict):
        for v in value.values():
            yield from _flatten(v)
    else:
        yield value


def _traced(tracing: _Tracing, value) -> Traced:
    return value if isinstance(value, Traced) else Traced(_unwrap(value, tracing), tracing)


def _unary(op: str):
    def handler(tracing, x, *rest, **kwargs):
        if rest or kwargs:
            raise tracing.error(f"torch.{op} with more arguments (out=, ...)")
        return Traced(_make(tracing, op, _unwrap(x, tracing)), tracing)
    return handler


def _binary_function(op: str):
    def handler(tracing, a, b, *rest, **kwargs):
        if rest or kwargs:
            raise tracing.error(f"torch {op} with more arguments (out=, alpha=, ...)")
        return Traced(_make(tracing, op, _unwrap(a, tracing), _unwrap(b, tracing)), tracing)
    return handler


def _where(tracing, condition, x=None, y=None):
    if x is None or y is None:
        raise tracing.error("torch.where(condition) with one argument")
    return Traced(_make(tracing, "where", _unwrap(condition, tracing), _unwrap(x, tracing), _unwrap(y, tracing)),
                  tracing)


def _clamp(x, min=None, max=None):  # noqa: A002 - torch's names
    tracing = x.tracing if isinstance(x, Traced) else None
    node = _unwrap(x, tracing)
    if min is not None:
        node = make("maximum", node, _unwrap(min, tracing))
    if max is not None:
        node = make("minimum", node, _unwrap(max, tracing))
    return Traced(node, tracing)


def _clamp_function(tracing, x, min=None, max=None):  # noqa: A002
    return _clamp(_traced(tracing, x), min, max)


def _index(tracing: _Tracing, tensor, index):
    """``tensor[index]`` for a captured tensor indexed by traced values (and ints), one index a dim."""
    if isinstance(tensor, Traced) or not isinstance(tensor, torch.Tensor):
        raise tracing.error("indexing a traced value", "it is a scalar")
    index = index if isinstance(index, tuple) else (index,)
    if any(i is None or i is Ellipsis or isinstance(i, (slice, torch.Tensor)) for i in index):
        raise tracing.error("a slice, None, ... or a tensor in a captured tensor's index",
                            "index each dim by one value")
    if len(index) != tensor.dim():
        raise tracing.error(f"indexing a {tensor.dim()}-dim captured tensor with {len(index)} indices",
                            "index each dim by one value")
    dtype = str(tensor.dtype).removeprefix("torch.")
    if dtype not in program_flex.CAPTURE_DTYPES:
        raise tracing.error(f"a captured tensor of dtype {tensor.dtype}",
                            f"one of {sorted(program_flex.CAPTURE_DTYPES)}")
    nodes = [_unwrap(i, tracing) for i in index]
    try:
        node = program_flex.load(tracing.capture(tensor), dtype, nodes)
    except TypeError as err:
        raise tracing.error(f"indexing a captured tensor: {err}") from None
    return Traced(node, tracing)


_TORCH_FUNCTIONS = {
    torch.where: _where,
    torch.tanh: _unary("tanh"), torch.Tensor.tanh: _unary("tanh"),
    torch.exp: _unary("exp"), torch.Tensor.exp: _unary("exp"),
    torch.log: _unary("log"), torch.Tensor.log: _unary("log"),
    torch.sqrt: _unary("sqrt"), torch.Tensor.sqrt: _unary("sqrt"),
    torch.sigmoid: _unary("sigmoid"), torch.Tensor.sigmoid: _unary("sigmoid"),
    torch.abs: _unary("abs"), torch.Tensor.abs: _unary("abs"),
    torch.neg: _unary("neg"),
    torch.logical_not: lambda tracing, x: Traced(make("not", program_flex.cast(_unwrap(x, tracing), BOOL)), tracing),
    torch.minimum: _binary_function("minimum"), torch.maximum: _binary_function("maximum"),
    torch.min: _binary_function("minimum"), torch.max: _binary_function("maximum"),
    torch.add: _binary_function("add"), torch.sub: _binary_function("sub"), torch.mul: _binary_function("mul"),
    torch.div: _binary_function("div"), torch.floor_divide: _binary_function("floordiv"),
    torch.remainder: _binary_function("mod"),
    torch.logical_and: lambda t, a, b: Traced(make("and", *(program_flex.cast(_unwrap(x, t), BOOL) for x in (a, b))), t),
    torch.logical_or: lambda t, a, b: Traced(make("or", *(program_flex.cast(_unwrap(x, t), BOOL) for x in (a, b))), t),
    torch.clamp: _clamp_function, torch.clip: _clamp_function,
}
# operator.* and torch.Tensor's dunder methods reach __torch_function__ when the left operand is a tensor
# (a captured 0-dim tensor, say): refused by _unwrap with its own message
for _name, _op in (("__add__", "add"), ("__radd__", "add"), ("__mul__", "mul"), ("__rmul__", "mul"),
                   ("__sub__", "sub"), ("__truediv__", "div")):
    _TORCH_FUNCTIONS[getattr(torch.Tensor, _name)] = _binary_function(_op)


def trace(fn, what: str) -> tuple[Node, list[torch.Tensor]]:
    """Run ``fn`` (``what``: "score_mod" or "mask_mod") on symbolic values: the tree of its result and
    the tensors it reads, in order. A score_mod's result is a float, a mask_mod's a bool."""
    if not callable(fn):
        raise TypeError(f"{what}: expected a function, got {type(fn).__name__}")
    tracing = _Tracing(fn, what)
    leaves = ("score", "b", "h", "q_idx", "kv_idx") if what == "score_mod" else ("b", "h", "q_idx", "kv_idx")
    args = [Traced(Node(name, FLOAT if name == "score" else INT32), tracing) for name in leaves]
    result = fn(*args)
    try:
        node = _unwrap(result, tracing)
    except FlexTraceError:
        raise FlexTraceError(f"{what}: expected a traced value or a number back, got {type(result).__name__}") from None
    want = FLOAT if what == "score_mod" else BOOL
    if what == "score_mod" and node.dtype != FLOAT:
        node = program_flex.cast(node, FLOAT)
    if node.dtype != want:
        raise FlexTraceError(f"{what}: expected a bool value back (True: the key is seen), got a {node.dtype} one")
    return node, tracing.captures


def trace_mods(score_mod, mask_mod) -> tuple[FlexMods, list[torch.Tensor]]:
    """Both mods traced into one ``FlexMods`` (either may be None) and the tensors they capture, the
    score_mod's first; a tensor both read is one capture. The same mods reading the same objects give the
    same FlexMods object again, untraced (``_TRACED``)."""
    reads = [_reads(fn) if fn is not None else [] for fn in (score_mod, mask_mod)]
    if any(r is None for r in reads):
        return _trace_mods(score_mod, mask_mod)
    key = tuple(tuple(_identity(x) for x in r) for r in reads)  # each mod's own: (None, f) is not (f, None)
    flat = [x for r in reads for x in r]
    found = _TRACED.get(key)
    if found is not None:
        refs, tensors, mods, captures = found
        captured = [ref() for ref in captures]
        # (each tested by identity: ``None in`` a list of tensors calls Tensor.__eq__, microseconds a tensor)
        if all(ref is None or ref() is x for ref, x in zip(refs, flat)) and all(t is not None for t in captured) \
                and tensors == _tensor_state(flat, captured):
            return mods, captured
    mods, captures = _trace_mods(score_mod, mask_mod)
    if len(_TRACED) >= _TRACED_KEPT:
        _TRACED.pop(next(iter(_TRACED)))
    _TRACED[key] = ([None if _is_value(x) else weakref.ref(x) for x in flat], _tensor_state(flat, captures),
                    mods, [weakref.ref(t) for t in captures])
    return mods, captures


# trace_mods' results by what the mods can depend on besides their arguments (``_reads``): values (numbers,
# strings, dtypes) compared by value, other objects by identity through weak references, so that an entry
# keeps no tensor, closure or autograd graph alive. Tracing runs the mods in Python (tens to hundreds of
# microseconds a call), which a training loop's calls then skip.
_TRACED: dict[tuple, tuple] = {}
_TRACED_KEPT = 32
# the modules whose functions a mod may call and still be cached (their attributes are taken as fixed)
_TRUSTED_MODULES = (torch, torch.nn.functional, math, operator)
_VALUES = (int, float, complex, bool, str, bytes, type(None), torch.dtype, torch.device)
_MISSING = "<a global the function names and does not have>"


def _is_value(x) -> bool:
    return isinstance(x, _VALUES) or (isinstance(x, tuple) and all(isinstance(v, _VALUES) for v in x))


def _identity(x):
    return ("value", x) if _is_value(x) else ("object", id(x))


def _reads(fn, depth: int = 0) -> list | None:
    """What a mod's result can depend on besides its arguments: its code, its defaults, the contents of its
    closure and the globals it names (functions it calls, recursively), or None where that is not known: a
    callable that is no plain function, code that defines functions of its own, a mutable value (a dict, a
    list, an object's or an untrusted module's attributes) or calls nested too deep. A tensor counts by its
    identity, dtype, shape and device, and where the trace does not capture it (a value read into a Python
    number) by its version too (``_tensor_state``)."""
    if isinstance(fn, types.BuiltinFunctionType):
        owner = fn.__self__
        return [fn] if owner is None or any(owner is m for m in _TRUSTED_MODULES) else None
    if not isinstance(fn, types.FunctionType) or depth > 3:
        return None
    code = fn.__code__
    if any(isinstance(c, types.CodeType) for c in code.co_consts):  # a lambda or def inside: its reads unseen
        return None
    try:
        cells = [c.cell_contents for c in fn.__closure__ or ()]
    except ValueError:  # a cell not yet assigned
        return None
    values = [*cells, *(fn.__defaults__ or ()), *(fn.__kwdefaults__ or {}).values(),
              *(fn.__globals__.get(name, _MISSING) for name in code.co_names)]
    # the code, not the function object: a lambda made anew at every call (``score_mod=lambda ...`` in a model's
    # forward) over the same objects is the same trace, and whatever else a function object holds that its code
    # can read (closure, defaults, globals) is read below
    reads = [code]
    for value in values:
        if _is_value(value) or isinstance(value, torch.Tensor) or any(value is m for m in _TRUSTED_MODULES):
            reads.append(value)
        else:
            inner = _reads(value, depth + 1) if callable(value) else None
            if inner is None:
                return None
            reads.extend(inner)
    return reads


def _tensor_state(reads: list, captures) -> tuple:
    """Each tensor of ``reads`` (the mods' flattened) as the trace depends on it: dtype, shape, device and,
    where the trace does not capture it, its version."""
    captured = {id(t) for t in captures}
    return tuple((x.dtype, x.shape, x.device, None if id(x) in captured else x._version)
                 for x in reads if isinstance(x, torch.Tensor))


def trace_uncached(score_mod, mask_mod) -> tuple[FlexMods, list[torch.Tensor]]:
    """``trace_mods`` without its cache (``_TRACED``): what torch.compile traces, Dynamo running the tracer and
    the mods on its symbolic values, and guarding the compiled graph on everything the mods read. Under
    ``_CapturedIndexing``: Dynamo takes ``tensor[traced]`` for a graph operation, not for the Traced index's
    ``__torch_function__`` (which eagerly answers it), but it does run a torch function mode's."""
    with _CapturedIndexing():
        return _trace_mods(score_mod, mask_mod)


class _CapturedIndexing(torch.overrides.TorchFunctionMode):
    """Indexing a captured tensor by traced values (``_index``), as a torch function mode."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is torch.Tensor.__getitem__ and len(args) == 2 and isinstance(args[0], torch.Tensor):
            index = args[1] if isinstance(args[1], tuple) else (args[1],)
            traced = [i for i in index if isinstance(i, Traced)]
            if traced:
                return _index(traced[0].tracing, *args)
        return func(*args, **(kwargs or {}))


def _trace_mods(score_mod, mask_mod) -> tuple[FlexMods, list[torch.Tensor]]:
    captures: list[torch.Tensor] = []
    nodes = []
    for fn, what in ((score_mod, "score_mod"), (mask_mod, "mask_mod")):
        if fn is None:
            nodes.append(None)
            continue
        node, own = trace(fn, what)
        nodes.append(_renumber(node, own, captures))
    described = tuple((str(t.dtype).removeprefix("torch."), t.dim()) for t in captures)
    return FlexMods(nodes[0], nodes[1], described), captures


def _renumber(node: Node, own: list, captures: list) -> Node:
    """``node`` with its loads' capture numbers those of ``captures`` (each of ``own`` added once)."""
    numbers = []
    for t in own:
        found = next((n for n, seen in enumerate(captures) if seen is t), None)
        if found is None:
            captures.append(t)
            found = len(captures) - 1
        numbers.append(found)

    def walk(n: Node) -> Node:
        args = tuple(walk(a) for a in n.args)
        value = numbers[n.value] if n.op == "load" else n.value
        return Node(n.op, n.dtype, args, value)
    return walk(node)


# ----------------------------------------------------------------------------- indices in range
def check_indices(mods: FlexMods, captures, batch: int, heads: int, seqlen_q: int, seqlen_k: int) -> None:
    """A ValueError unless every load of the mods reads inside its captured tensor for every b < batch,
    h < heads, q_idx < seqlen_q and kv_idx < seqlen_k: each index's range is bounded from its
    expression (interval arithmetic; an index computed from a captured tensor's values takes that
    tensor's smallest and largest, read here). The bound may be wider than the values the index takes
    (a ``torch.where`` that guards a load is not followed): clamp such an index (``clamp``,
    ``torch.minimum``). The kernels read nothing outside a tensor, and an index out of range is no
    wrap-around (torch's negative indices) but an error here."""
    leaves = {"b": (0, batch - 1), "h": (0, heads - 1), "q_idx": (0, seqlen_q - 1), "kv_idx": (0, seqlen_k - 1)}
    values: dict[int, tuple] = {}  # capture number -> (min, max) of its values, read on first need

    def value_range(n: int) -> tuple:
        if n not in values:
            t = captures[n]
            lo, hi = (t.to(torch.int64) if t.dtype == torch.bool else t).aminmax()
            values[n] = (lo.item(), hi.item())
        return values[n]

    def visit(node: Node) -> None:
        """Check every load under ``node``, whose value is no index (no value range read: on a GPU each is a
        synchronisation, a document mask's ``doc[q_idx] == doc[kv_idx]`` two a call)."""
        if node.op == "load":
            check(node)
        else:
            for a in node.args:
                visit(a)

    def bounds(node: Node) -> tuple:
        """The range of an index's value (and its loads checked)."""
        op = node.op
        if op in leaves:
            return leaves[op]
        if op == "const":
            return (node.value, node.value)
        if node.dtype == BOOL:
            visit(node)
            return (0, 1)
        if node.dtype == FLOAT:
            visit(node)
            return (-math.inf, math.inf)
        if op == "load":
            check(node)
            return value_range(node.value)
        spans = [bounds(a) for a in node.args]
        if op == "cast":
            return spans[0]
        if op == "add":
            return (spans[0][0] + spans[1][0], spans[0][1] + spans[1][1])
        if op == "sub":
            return (spans[0][0] - spans[1][1], spans[0][1] - spans[1][0])
        if op == "neg":
            return (-spans[0][1], -spans[0][0])
        if op == "mul":
            products = [x * y for x in spans[0] for y in spans[1]]
            return (min(products), max(products))
        if op == "abs":
            lo, hi = spans[0]
            return (0 if lo <= 0 <= hi else min(abs(lo), abs(hi)), max(abs(lo), abs(hi)))
        if op == "minimum":
            return (min(spans[0][0], spans[1][0]), min(spans[0][1], spans[1][1]))
        if op == "maximum":
            return (max(spans[0][0], spans[1][0]), max(spans[0][1], spans[1][1]))
        if op == "where":
            return (min(spans[1][0], spans[2][0]), max(spans[1][1], spans[2][1]))
        if op == "floordiv" and spans[1][0] == spans[1][1] and spans[1][0] > 0:
            d = spans[1][0]
            return (spans[0][0] // d, spans[0][1] // d)
        if op == "mod" and spans[1][0] > 0:
            return (0, spans[1][1] - 1)
        return (-math.inf, math.inf)

    def check(node: Node) -> None:
        t = captures[node.value]
        for axis, index in enumerate(node.args):
            lo, hi = bounds(index)
            if lo < 0 or hi >= t.shape[axis]:
                raise ValueError(
                    f"captured tensor {node.value} (shape {tuple(t.shape)}): its index in dim {axis} may take values "
                    f"from {lo} to {hi} (batch {batch}, heads {heads}, seqlen_q {seqlen_q}, seqlen_k {seqlen_k}), "
                    f"outside 0 ... {t.shape[axis] - 1}; clamp it (torch.clamp) into the tensor")

    for node in (mods.score, mods.mask):
        if node is not None:
            visit(node)
