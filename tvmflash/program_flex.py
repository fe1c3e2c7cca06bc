"""A user's ``score_mod`` and ``mask_mod`` (PyTorch FlexAttention's) as expressions of the programs.

``tvmflash.flex_trace`` runs the user's Python functions on symbolic values and records what they compute
as a tree of ``Node``; this module holds that tree, builds it (``make``: torch's type promotion, one
place), writes it as TIR inside the programs' blocks (``FlexTile``) and derives d(score_mod)/d(score) for
the backward (``derivative``). The tree is data: equal functions give equal trees, and the tree (never
the Python function) is part of the spec that keys a built module.

Leaves: ``score`` (float32, the scaled q·k), ``b``, ``h``, ``q_idx``, ``kv_idx`` (int32: the batch, the
query head, the query's and the key's positions in their sequences, 0-based as FlexAttention's), Python
constants, and loads from the captured tensors (``load``: its ``value`` the capture's number, its args the
indices). Each captured tensor is one more argument of the programs, after softmax_scale: compact, of
the dtype and the number of dims ``FlexMods.captures`` names, any sizes (``flex_arguments``).

Values are float32, int32, int64 or bool. Float captures (float16, bfloat16, float32) are read as float32,
bool ones as uint8 (torch's bool is a byte; ``tvmflash.flex_trace`` passes a uint8 view).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from tvm import tirx
from tvm.script import tirx as T
from tvm.script.ir_builder import IRBuilder

from tvmflash.program_block_sparse import SPARSE_ARGUMENTS

FLOAT, INT32, INT64, BOOL = "float32", "int32", "int64", "bool"
# The storage dtypes a captured tensor may have (torch's names), and the value dtype each is read as.
CAPTURE_DTYPES = {"float32": FLOAT, "float16": FLOAT, "bfloat16": FLOAT, "int32": INT32, "int64": INT64,
                  "bool": BOOL, "uint8": INT32, "int8": INT32, "int16": INT32}
# A capture's dtype in the programs (bool: its bytes, as uint8).
STORAGE_DTYPES = {"bool": "uint8"}

LEAVES = ("score", "b", "h", "q_idx", "kv_idx")
ARITHMETIC = ("add", "sub", "mul", "div", "floordiv", "mod", "minimum", "maximum")
COMPARISONS = ("lt", "le", "gt", "ge", "eq", "ne")
LOGICAL = ("and", "or", "xor")
FLOAT_FUNCTIONS = ("tanh", "exp", "log", "sqrt", "sigmoid")
UNARY = ("neg", "abs", "not", *FLOAT_FUNCTIONS)


@dataclass(frozen=True)
class Node:
    """One value of a traced function: ``op`` of ``args`` (Nodes), of ``dtype``. ``value``: a
    constant's value (op "const"), a load's capture number (op "load", args its indices), a cast's
    target is its dtype (op "cast")."""

    op: str
    dtype: str
    args: tuple = ()
    value: object = None


@dataclass(frozen=True)
class FlexMods:
    """The score_mod and mask_mod of a FlexAttention call, traced (either may be None), and the dtype
    and number of dims of each captured tensor they load from, in argument order. Part of
    ``program.AttentionSpec`` (its ``flex`` field): one built module per distinct pair of trees."""

    score: Node | None = None
    mask: Node | None = None
    captures: tuple = ()  # ((torch dtype name, ndim), ...)
    # A BlockMask's block sparsity: its (Q, KV) BLOCK_SIZE, or None (every tile visited, masked by
    # mask_mod). With it the programs take its lists as four more arguments (``BlockSparse``).
    sparse: tuple | None = None
    # The captures (their numbers, float ones the score_mod loads) whose gradient dkdv adds into float32
    # buffers, one more parameter each (``program_flex_gradient``); () for the forward and where torch makes it.
    learned: tuple = ()

    def __post_init__(self):
        if self.score is not None and self.score.dtype != FLOAT:
            raise ValueError(f"score_mod: expected a float score back, got a {self.score.dtype} value")
        if self.mask is not None and self.mask.dtype != BOOL:
            raise ValueError(f"mask_mod: expected a bool value back (True: the key is seen), got a "
                             f"{self.mask.dtype} value")
        for dtype, ndim in self.captures:
            if dtype not in CAPTURE_DTYPES or not isinstance(ndim, int) or ndim < 1:
                raise ValueError(f"captured tensor: expected one of {sorted(CAPTURE_DTYPES)} with at least one "
                                 f"dim, got {dtype} with {ndim}")
        if self.sparse is not None and not (isinstance(self.sparse, tuple) and len(self.sparse) == 2 and all(
                isinstance(n, int) and not isinstance(n, bool) and n > 0 for n in self.sparse)):
            raise ValueError(f"sparse: expected a BlockMask's (Q, KV) block size, two positive ints, got "
                             f"{self.sparse!r}")
        if any(not isinstance(n, int) or not 0 <= n < len(self.captures) or CAPTURE_DTYPES[self.captures[n][0]] != FLOAT
               for n in self.learned) or len(set(self.learned)) != len(self.learned) or \
                (self.learned and self.score is None):
            raise ValueError(f"learned: expected distinct numbers of float captures a score_mod reads, got "
                             f"{self.learned!r} of {self.captures!r}")

    @property
    def describe(self) -> str:
        """A short name for logs: which mods are on, and how many tensors they capture."""
        parts = [name for name, node in (("score_mod", self.score), ("mask_mod", self.mask)) if node is not None]
        if self.sparse is not None:
            parts.append("block_mask{}x{}".format(*self.sparse))
        if self.learned:
            parts.append(f"gradient{list(self.learned)}")
        return "+".join(parts) + (f"({len(self.captures)} captured)" if self.captures else "")


# ----------------------------------------------------------------------------- building trees
def const(value) -> Node:
    """A Python bool, int or float as a Node (an int past int32 is int64)."""
    if isinstance(value, bool):
        return Node("const", BOOL, value=value)
    if isinstance(value, int):
        return Node("const", INT32 if -2**31 <= value < 2**31 else INT64, value=value)
    if isinstance(value, float):
        return Node("const", FLOAT, value=value)
    raise TypeError(f"expected a bool, int or float constant, got {type(value).__name__}")


def cast(node: Node, dtype: str) -> Node:
    if node.dtype == dtype:
        return node
    if node.op == "const":
        value = {FLOAT: float, BOOL: bool}.get(dtype, int)(node.value)
        return Node("const", dtype, value=value)
    return Node("cast", dtype, (node,))


def _numeric(dtypes) -> str:
    """torch's promotion of operands of these dtypes in arithmetic: float32 if any is float, else the
    widest int (bool counts as int32)."""
    if FLOAT in dtypes:
        return FLOAT
    return INT64 if INT64 in dtypes else INT32


def make(op: str, *operands) -> Node:
    """The Node of ``op`` on ``operands`` (Nodes or Python constants), its dtype by torch's rules;
    constants folded where both sides are."""
    args = tuple(a if isinstance(a, Node) else const(a) for a in operands)
    dtypes = [a.dtype for a in args]
    if op in ARITHMETIC:
        dtype = FLOAT if op == "div" else _numeric(dtypes)  # true division, as torch's /
        return _fold(Node(op, dtype, tuple(cast(a, dtype) for a in args)))
    if op in COMPARISONS:
        common = BOOL if dtypes == [BOOL, BOOL] else _numeric(dtypes)
        return _fold(Node(op, BOOL, tuple(cast(a, common) for a in args)))
    if op in LOGICAL:
        if FLOAT in dtypes:
            raise TypeError(f"{op}: expected bool or integer operands, got {dtypes}")
        dtype = BOOL if dtypes == [BOOL, BOOL] else _numeric(dtypes)
        return _fold(Node(op, dtype, tuple(cast(a, dtype) for a in args)))
    if op == "not":
        (a,) = args
        if a.dtype == FLOAT:
            raise TypeError("~: expected a bool or integer operand, got a float")
        return _fold(Node("not", a.dtype, args))
    if op == "neg":
        (a,) = args
        if a.dtype == BOOL:
            raise TypeError("-: negation of a bool value (torch refuses it too); use ~")
        return _fold(Node("neg", a.dtype, args))
    if op == "abs":
        (a,) = args
        a = cast(a, INT32) if a.dtype == BOOL else a
        return _fold(Node("abs", a.dtype, (a,)))
    if op in FLOAT_FUNCTIONS:
        (a,) = args
        return _fold(Node(op, FLOAT, (cast(a, FLOAT),)))
    if op == "where":
        condition, x, y = args
        dtype = _numeric([x.dtype, y.dtype]) if (x.dtype, y.dtype) != (BOOL, BOOL) else BOOL
        return _fold(Node("where", dtype, (cast(condition, BOOL), cast(x, dtype), cast(y, dtype))))
    raise ValueError(f"unknown operation {op!r}")


def load(capture: int, dtype: str, indices) -> Node:
    """A load of captured tensor number ``capture`` (of torch dtype ``dtype``) at ``indices`` (Nodes
    or ints; each cast to an integer)."""
    index = []
    for i in indices:
        i = i if isinstance(i, Node) else const(i)
        if i.dtype == FLOAT:
            raise TypeError("tensor index: expected an integer or bool value, got a float one")
        index.append(cast(i, INT32) if i.dtype == BOOL else i)
    return Node("load", CAPTURE_DTYPES[dtype], tuple(index), capture)


_PYTHON = {
    "add": lambda a, b: a + b, "sub": lambda a, b: a - b, "mul": lambda a, b: a * b,
    "minimum": min, "maximum": max, "lt": lambda a, b: a < b, "le": lambda a, b: a <= b,
    "gt": lambda a, b: a > b, "ge": lambda a, b: a >= b, "eq": lambda a, b: a == b, "ne": lambda a, b: a != b,
    "and": lambda a, b: a & b, "or": lambda a, b: a | b, "xor": lambda a, b: a ^ b,
}


def _fold(node: Node) -> Node:
    """``node`` with its value computed where every operand is a constant (only the operations whose
    Python value is float32's or exact), and the identities x + 0, x * 1, x * 0 (ints), where(const)."""
    args = node.args
    if node.op == "where" and args[0].op == "const":
        return args[1] if args[0].value else args[2]
    if all(a.op == "const" for a in args) and args and node.op in _PYTHON and node.dtype != FLOAT:
        return const_of(node.dtype, _PYTHON[node.op](*(a.value for a in args)))
    if node.op in ("add", "sub") and _is(args[1], 0):
        return args[0]
    if node.op == "add" and _is(args[0], 0):
        return args[1]
    if node.op == "mul":
        for x, y in (args, args[::-1]):
            if _is(x, 1):
                return y
            if _is(x, 0) and node.dtype != FLOAT:
                return x
    return node


def const_of(dtype: str, value) -> Node:
    return Node("const", dtype, value={FLOAT: float, BOOL: bool}.get(dtype, int)(value))


def _is(node: Node, value) -> bool:
    return node.op == "const" and node.dtype != BOOL and node.value == value


# ----------------------------------------------------------------------------- the derivative
SCORE = Node("score", FLOAT)


def derivative(node: Node, wrt: Node = SCORE) -> Node:
    """d node / d ``wrt`` (the score leaf, or a float load of a captured tensor: ``program_flex_gradient``), a
    float32 Node (0 where the node does not depend on it; through a comparison nothing: it is piecewise
    constant). The rules are torch autograd's: where(c, x, y) gives where(c, x', y'); abs' is sign (0 at 0);
    minimum and maximum pass the gradient to the side they take (at a tie, to the first); in a load's, a
    product's term whose factor's derivative is 0 is left out (torch's gradient of x * y in y is grad * x; the
    score's keeps its tree as the pinned kernels have it)."""
    if not _depends_on(node, wrt) or node.dtype != FLOAT:
        return const(0.0)
    op, args = node.op, node.args
    if node == wrt:
        return const(1.0)
    if op == "cast":
        return derivative(args[0], wrt)
    if op == "load":  # through its (integer) index: piecewise constant, as torch's indexing
        return const(0.0)
    d = [derivative(a, wrt) for a in args]
    if op == "add":
        return make("add", d[0], d[1])
    if op == "sub":
        return make("sub", d[0], d[1])
    if op == "neg":
        return make("neg", d[0])
    if op == "mul":
        for x, y, dx in ((args[0], args[1], d[0]), (args[1], args[0], d[1])):
            if y.op == "const":  # torch's: the gradient times the constant
                return _times(dx, float(y.value))
        if wrt.op != "score":  # a load's: only the terms whose factor's derivative is not 0 (torch's)
            terms = [make("mul", dx, y) for dx, y in ((d[0], args[1]), (d[1], args[0])) if not _is(dx, 0.0)]
            return terms[0] if len(terms) == 1 else make("add", *terms)
        return make("add", make("mul", d[0], args[1]), make("mul", args[0], d[1]))
    if op == "div":
        a, b = args
        if b.op == "const":
            return _times(d[0], 1 / float(b.value))
        return make("div", make("sub", make("mul", d[0], b), make("mul", a, d[1])), make("mul", b, b))
    if op == "where":
        return make("where", args[0], d[1], d[2])
    if op in ("minimum", "maximum"):
        takes_first = make("le" if op == "minimum" else "ge", args[0], args[1])
        return make("where", takes_first, d[0], d[1])
    if op == "abs":
        (x,) = args
        sign = make("where", make("gt", x, 0.0), 1.0, make("where", make("lt", x, 0.0), -1.0, 0.0))
        return make("mul", sign, d[0])
    if op == "tanh":
        return _product(make("sub", 1.0, make("mul", node, node)), d[0])
    if op == "sigmoid":
        return make("mul", make("mul", node, make("sub", 1.0, node)), d[0])
    if op == "exp":
        return make("mul", node, d[0])
    if op == "log":
        return make("div", d[0], args[0])
    if op == "sqrt":
        return make("div", d[0], make("mul", 2.0, node))
    raise NotImplementedError(f"score_mod: no derivative of {op} with respect to the {wrt.op}")


def _depends_on(node: Node, wrt: Node) -> bool:
    return node == wrt or any(_depends_on(a, wrt) for a in node.args)


def _times(node: Node, factor: float) -> Node:
    """``node`` times a constant, the constant factors of a product merged and a factor of 1 in float32 left
    out: the derivative of softcap * tanh(score / softcap) is then 1 - tanh², as the built-in softcap's,
    not (1 - tanh²) * (1 / softcap) * softcap, two multiplies a score more."""
    if node.op == "const":
        return const_of(FLOAT, float(node.value) * factor)
    if node.op == "mul" and node.args[1].op == "const":
        node, factor = node.args[0], float(node.args[1].value) * factor
    if float(np.float32(factor)) == 1.0:
        return node
    return make("mul", node, factor)


def _product(a: Node, b: Node) -> Node:
    if b.op == "const":
        return _times(a, float(b.value))
    if a.op == "const":
        return _times(b, float(a.value))
    return make("mul", a, b)


# ----------------------------------------------------------------------------- in the programs
def flex_arguments(spec):
    """With a spec's ``flex`` that captures tensors, one more parameter of the PrimFunc being parsed a
    captured tensor (compact, any sizes, its value dtype's storage: ``STORAGE_DTYPES``), after the
    others, then with block sparsity (``FlexMods.sparse``) the block lists (``SPARSE_ARGUMENTS``); their
    buffers in order, or None without flex."""
    flex = getattr(spec, "flex", None)
    if flex is None:
        return None
    buffers = []
    for n, (dtype, ndim) in enumerate(flex.captures):
        buffers.append(_compact_argument(f"captured{n}", f"Captured{n}", ndim, STORAGE_DTYPES.get(dtype, dtype)))
    if flex.sparse is not None:
        for name in SPARSE_ARGUMENTS:
            buffers.append(_compact_argument(name.lower(), name, 4, "int32"))
    return tuple(buffers)


def _compact_argument(name: str, buffer_name: str, ndim: int, dtype: str):
    """A compact parameter of ``ndim`` dims of any sizes (``{name}_size{axis}``)."""
    handle = T.arg(f"{name}_handle", T.handle())
    shape = []
    for axis in range(ndim):
        extent = T.int32()
        IRBuilder.name(f"{name}_size{axis}", extent)
        shape.append(extent)
    buffer = T.match_buffer(handle, tuple(shape), dtype)
    IRBuilder.name(buffer_name, buffer)
    return buffer


def flex_tile(spec, buffers, b, h, seqlen_q, seqlen_k):
    """The mods of the tile of batch b and query head h (``FlexTile``), or None without flex."""
    flex = getattr(spec, "flex", None)
    if flex is None:
        return None
    return FlexTile(flex, buffers, b, h, seqlen_q, seqlen_k, precise_tanh=spec.dtype == "float32")


@dataclass(frozen=True)
class FlexTile:
    """The score_mod and mask_mod of one (batch, query head) as TIR, at a query and a key position.

    The programs evaluate the mods on their padding rows and keys too, which the rest of the mask
    hides. A position that reaches a load's index, a divisor or a function that may overflow or give
    NaN (exp, log, sqrt) is clamped into its sequence (the last query or key) first, so that a load from
    a captured tensor stays inside it and such a value stays what some real position gives
    (``_clamped``); elsewhere it is used as it is, so that a mask_mod such as ``q_idx >= kv_idx`` is
    one comparison, as the built-in masks are."""

    mods: FlexMods
    buffers: tuple
    b: object
    h: object
    seqlen_q: object
    seqlen_k: object
    precise_tanh: bool = False

    def _env(self, node: Node, s, scale, row, col) -> dict:
        return {**(_scaled(s, scale) if s is not None else {}), "b": self.b, "h": self.h,
                "q_idx": T.min(row, self.seqlen_q - 1) if _clamped(node, "q_idx") else row,
                "kv_idx": T.min(col, self.seqlen_k - 1) if _clamped(node, "kv_idx") else col}

    def score(self, s, scale, row, col):
        """score_mod(s * scale, b, h, row, col), float32 (s: q·k unscaled); s * scale without a score_mod."""
        if self.mods.score is None:
            return s * scale
        return self._tir(self.mods.score, self._env(self.mods.score, s, scale, row, col))

    def score_gradient(self, ds, s, scale, row, col):
        """ds times d score_mod / d score at s * scale, or ds without a score_mod."""
        if self.mods.score is None:
            return ds
        gradient = derivative(self.mods.score)
        if _is(gradient, 1.0):
            return ds
        return ds * self._tir(gradient, self._env(gradient, s, scale, row, col))

    def tir(self, node: Node, s, scale, row, col, within: Node | None = None):
        """Any tree of the score_mod's leaves (a derivative; a load's index, ``within`` the load) at (row, col),
        its positions clamped as they are in ``within`` (by default the tree itself: ``_clamped``)."""
        return self._tir(node, self._env(node if within is None else within, s, scale, row, col))

    def visible(self, row, col):
        """mask_mod(b, h, row, col), a bool (True without a mask_mod)."""
        if self.mods.mask is None:
            return tirx.const(True, "bool")
        return self._tir(self.mods.mask, self._env(self.mods.mask, None, None, row, col))

    def _tir(self, node: Node, env: dict):
        return _to_tir(node, env, self.buffers, self.precise_tanh, {})


# ----------------------------------------------------------------------------- flash-attn's score variants
# The leaves that only the built-in variants' trees read: ALiBi's slope of the tile's (batch, head), and the
# distance i + seqlen_k - seqlen_q - j (bottom-right aligned, as flash-attn's), as the programs write them.
BUILTIN_LEAVES = {"slope": FLOAT, "distance": INT32}


@dataclass(frozen=True)
class BuiltinScore:
    """flash-attn's softcap and ALiBi as a score_mod's tree (``score``) and the derivative the backward takes
    (``gradient``: d score / d (the scaled score), None where it is 1), written by the same code as a user's
    mods (``_to_tir``). A new score variant is its tree here (and its field of ``program.AttentionSpec``).
    The derivative is written by hand, not by ``derivative``: its tree would hold the constant factors that
    cancel (softcap / softcap)."""

    score: Node
    gradient: Node | None

    def tir(self, s, scale, slope, distance, precise_tanh: bool):
        return _to_tir(self.score, {**_scaled(s, scale), "slope": slope, "distance": distance}, (), precise_tanh, {})

    def gradient_tir(self, ds, s, scale, precise_tanh: bool):
        if self.gradient is None:
            return ds
        return ds * _to_tir(self.gradient, _scaled(s, scale), (), precise_tanh, {})


def builtin_score(softcap: float, alibi: bool) -> BuiltinScore:
    """The score variants of a spec: softcap * tanh(score / softcap) (softcap > 0), then - slope * |distance|
    (ALiBi; flash-attn's order: the bias after the cap)."""
    score = Node("score", FLOAT)
    logit, gradient = score, None
    if softcap > 0:
        capped = make("tanh", make("div", score, float(softcap)))
        logit, gradient = make("mul", capped, float(softcap)), make("sub", 1.0, make("mul", capped, capped))
    if alibi:
        # |distance| as the float's absolute value, the same number (int32 to float32 rounds alike on both
        # sides of 0): an integer abs is select(d >= 0, d, -d), three copies of the distance in each score
        distance = cast(Node("distance", INT32), FLOAT)
        logit = make("sub", logit, make("mul", Node("slope", FLOAT), make("abs", distance)))
    return BuiltinScore(logit, gradient)


def _scaled(s, scale) -> dict:
    """The score leaf's values: s * scale, and s and the scale apart (``_to_tir`` folds a constant factor
    or divisor of the score into the scale, which is one multiply a tile: s * (scale * c))."""
    return {"score": s * scale, "_s": s, "_scale": scale}


def _folded(node: Node, env: dict):
    """``node`` (a product or quotient of the score leaf and a constant) as s * (scale * c), or None."""
    if node.op not in ("mul", "div") or "_s" not in env:
        return None
    a, b = node.args
    if node.op == "mul" and a.op == "const":
        a, b = b, a
    if a.op != "score" or b.op != "const":
        return None
    factor = float(b.value) if node.op == "mul" else 1 / float(b.value)
    return env["_s"] * (env["_scale"] * T.float32(factor))


def _reads(node: Node, leaf: str) -> bool:
    return node.op == leaf or any(_reads(a, leaf) for a in node.args)


def _clamped(node: Node, leaf: str) -> bool:
    """Must position ``leaf`` ("q_idx", "kv_idx") be clamped into its sequence in ``node``? Where it
    reaches a load's index (which must stay inside the tensor), a divisor (0 past the sequence, where
    none was inside it: a trap on the CPU), or exp, log or sqrt (a value inf or NaN past the sequence,
    which the mask's -inf added to a score would not hide)."""
    if node.op == "load" and any(_reads(a, leaf) for a in node.args):
        return True
    if node.op in ("div", "floordiv", "mod") and _reads(node.args[1], leaf):
        return True
    if node.op in ("exp", "log", "sqrt") and _reads(node.args[0], leaf):
        return True
    return any(_clamped(a, leaf) for a in node.args)


_TIR_DTYPES = {FLOAT: "float32", INT32: "int32", INT64: "int64", BOOL: "bool"}


def _constant(dtype: str, value):
    if dtype == FLOAT:
        return tirx.const(float(value), "float32")
    if dtype == BOOL:
        return tirx.const(bool(value), "bool")
    return tirx.const(int(value), dtype)


def _tanh(x, precise: bool):
    """tanh of a float32 value, as precise as the dtype needs (``precise``: float32 programs): CUDA's tanhf,
    under the fast math that the kernels are built with, is tanh.approx.f32 (relative error 2^-11), within
    the rounding of fp16 and bf16 but a thousand times float32's. In float32: 1 - 2 / (e^2x + 1), from exp2
    (relative error 2^-22; an absolute error of about 1e-7 near 0, where it cancels)."""
    if not precise:
        return T.tanh(x)
    return T.float32(1) - T.float32(2) / (T.exp2(x * T.float32(2 * math.log2(math.e))) + T.float32(1))


def _to_tir(node: Node, env: dict, buffers, precise_tanh: bool, memo: dict):
    """The TIR expression of ``node`` (``memo``: the expression of each node already written, so a
    value used twice is one expression, which common-subexpression elimination then computes once)."""
    found = memo.get(id(node))
    if found is not None:
        return found[1]
    op, dtype = node.op, node.dtype
    result = _folded(node, env)
    if result is None and op == "cast" and dtype == FLOAT and node.args[0].op == "abs" and node.args[0].dtype != FLOAT:
        # an integer's |x| as a float: the float's absolute value, the same number (int to float32 rounds alike
        # on both sides of 0), a free operand modifier where the integer's is max(x, -x) a score (ALiBi's
        # |q_idx - kv_idx|, as the built-in ALiBi writes it)
        (x,) = node.args[0].args
        result = T.abs(T.cast(_to_tir(x, env, buffers, precise_tanh, memo), "float32"))
    if result is not None:
        memo[id(node)] = (node, result)
        return result
    args = [_to_tir(a, env, buffers, precise_tanh, memo) for a in node.args] if op != "load" else None
    if op in LEAVES or op in BUILTIN_LEAVES:
        result = env[op]
    elif op == "const":
        result = _constant(dtype, node.value)
    elif op == "cast":
        (a,) = args
        result = tirx.NE(a, _constant(node.args[0].dtype, 0)) if dtype == BOOL else T.cast(a, _TIR_DTYPES[dtype])
    elif op == "load":
        index = [_to_tir(a, env, buffers, precise_tanh, memo) for a in node.args]
        buffer = buffers[node.value]
        value = buffer[tuple(index)]
        storage = str(buffer.dtype)
        if dtype == BOOL:
            result = tirx.NE(value, tirx.const(0, storage))
        elif storage != _TIR_DTYPES[dtype]:
            result = T.cast(value, _TIR_DTYPES[dtype])
        else:
            result = value
    elif op == "add":
        result = args[0] + args[1]
    elif op == "sub":
        result = args[0] - args[1]
    elif op == "mul":
        result = args[0] * args[1]
    elif op == "div":
        result = tirx.Div(args[0], args[1])
    elif op == "floordiv":
        result = T.floor(tirx.Div(args[0], args[1])) if dtype == FLOAT else tirx.floordiv(args[0], args[1])
    elif op == "mod":  # Python's (and torch's): the sign of the divisor
        if dtype == FLOAT:
            result = args[0] - T.floor(tirx.Div(args[0], args[1])) * args[1]
        else:
            result = tirx.floormod(args[0], args[1])
    elif op == "minimum":
        result = T.min(args[0], args[1])
    elif op == "maximum":
        result = T.max(args[0], args[1])
    elif op in COMPARISONS:
        result = {"lt": tirx.LT, "le": tirx.LE, "gt": tirx.GT, "ge": tirx.GE, "eq": tirx.EQ, "ne": tirx.NE}[op](*args)
    elif op in LOGICAL:  # bitwise on bools too: both sides are evaluated, as the programs' masks are
        result = {"and": T.bitwise_and, "or": T.bitwise_or, "xor": T.bitwise_xor}[op](*args)
    elif op == "not":
        result = tirx.Not(args[0]) if dtype == BOOL else T.bitwise_not(args[0])
    elif op == "neg":
        result = _constant(dtype, 0) - args[0]
    elif op == "abs":  # an integer's as max(x, -x), two copies of x where T.abs's select(x >= 0, x, -x) has three
        result = T.abs(args[0]) if dtype == FLOAT else T.max(args[0], _constant(dtype, 0) - args[0])
    elif op == "tanh":
        result = _tanh(args[0], precise_tanh)
    elif op == "sigmoid":
        result = T.float32(1) / (T.float32(1) + T.exp(T.float32(0) - args[0]))
    elif op in ("exp", "log", "sqrt"):
        result = {"exp": T.exp, "log": T.log, "sqrt": T.sqrt}[op](args[0])
    elif op == "where":  # only the branch taken is evaluated (a load in the other may be out of range)
        result = T.if_then_else(args[0], args[1], args[2])
    else:
        raise ValueError(f"unknown operation {op!r}")
    memo[id(node)] = (node, result)
    return result
