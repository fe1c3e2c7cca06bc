"""What the attention programs share: the static spec (``AttentionSpec``), the constants of the online
softmax, the variants (a sliding window, a softcap, ALiBi, sinks) as expressions, the masks and the tiles
they leave, packed sequences, and strided arguments. The programs are ``program_forward``,
``program_backward`` and ``program_decode``; each states *what* is computed and nothing about *how* it maps
to hardware: schedules in ``schedules/`` transform a program by its block names (``load_q``, ``qk``, ...).

Layout (flash-attn's):
    q:   (batch, seqlen_q, heads_q,  head_dim)   dtype
    k,v: (batch, seqlen_k, heads_kv, head_dim)   dtype
    out: (batch, seqlen_q, heads_q,  head_dim)   dtype
    lse: (batch, heads_q,  seqlen_q)              float32, natural log

batch, seqlen_q and seqlen_k are symbolic, so one built module serves every length. q, k, v and
out have symbolic batch, sequence and head strides (in elements) and a contiguous head_dim; lse is
compact. head_dim, the head counts, dtype, causal, the variants (``AttentionSpec``) and the tile sizes
are static."""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import tvm
from tvm.script import tirx as T
from tvm.script.ir_builder import IRBuilder

from tvmflash.lowering.annotations import RUNS_IF
from tvmflash.program_flex import FlexMods, builtin_score

SUPPORTED_DTYPES = ("float16", "bfloat16", "float32")
# FP8 (FlashAttention-3's e4m3 forward): q, k, v in e4m3 with float32 descales of shape (batch, heads_kv),
# the output in bf16 (``output_dtype``); the forward program alone takes it (``fp8_arguments``).
FP8 = "float8_e4m3fn"
FP8_OUTPUT = "bfloat16"
FP8_HEAD_DIM_MULTIPLE = 16  # a 16-byte vector of e4m3
# The programs take a head_dim that is a multiple of 8 (a 16-byte vector of fp16 or bf16, the unit the
# schedules copy in) up to 256, flash-attn's largest. Which of them each schedule builds it declares
# itself (``ProgramSchedule.head_dims``); the torch API zero-pads any head_dim from 1 to 256 to one the
# chosen kernels serve (``tvmflash.choice.head_dim_to_run``).
HEAD_DIM_MULTIPLE = 8
MAX_HEAD_DIM = 256
SUPPORTED_HEAD_DIMS = tuple(range(HEAD_DIM_MULTIPLE, MAX_HEAD_DIM + 1, HEAD_DIM_MULTIPLE))

LOG2E = math.log2(math.e)
LN2 = math.log(2.0)
# The running max starts finite, so exp2(score - max) is 0, never NaN, for masked scores (-inf).
# Scores are far inside this bound for any input whose dot products fit in float32.
NO_MAX = -1.0e30
# exp2 takes (score - max) * softmax_scale * log2 e, and a row that sees no key keeps NO_MAX as its
# max: the scale must keep NO_MAX * scale finite in float32 (then exp2(-inf) is 0, never NaN).
MAX_SOFTMAX_SCALE = 1.0e8
# The running max moves only when a tile's max passes it by more than this, in log2 units (FA4's
# rule): P = exp2((S - max) * scale2) then stays at most 2^8 = 256, which fp16 and bf16 hold with
# their usual relative precision, and the result is as exact as with the true max (the sum l uses
# the same stale max). alpha is then exactly 1 on most tiles, so a schedule can skip the output's
# rescale there (sm90: ``annotations.SKIP_UNIT_RESCALE_PRAGMA``).
RESCALE_THRESHOLD = 8.0
# A window bound this large is no bound (``tvmflash.kernels.checks.resolve_variant``): no sequence is that long
# (a tensor holds less than 2**31 elements, and head_dim is 8 or more), and the int32 index arithmetic
# of the window's edges, a position plus or minus the bound, stays in range.
MAX_WINDOW = 2**30


def check_head_dim(head_dim) -> int:
    """``head_dim`` where the programs serve it (``SUPPORTED_HEAD_DIMS``), else a ValueError saying what
    they take: the one check of a spec's (64.0, an int's equal, failed deep in TVM). The torch API
    checks q's last dim against 1 ... ``MAX_HEAD_DIM`` first (``kernels.checks.check_any_head_dim``)
    and pads it to one of these."""
    if not isinstance(head_dim, int) or isinstance(head_dim, bool) or head_dim not in SUPPORTED_HEAD_DIMS:
        raise ValueError(f"head_dim: expected a multiple of {HEAD_DIM_MULTIPLE} from {HEAD_DIM_MULTIPLE} to "
                         f"{MAX_HEAD_DIM}, got {head_dim!r} (tvmflash.attention and the flash_attn functions take "
                         f"any head_dim from 1 to {MAX_HEAD_DIM}: they pad it)")
    return head_dim


@dataclass(frozen=True)
class AttentionSpec:
    """The static part of an attention problem: one built module per spec."""

    head_dim: int
    dtype: str
    causal: bool = False
    heads_q: int = 1
    heads_kv: int = 1
    # flash-attn's variants. Key j is visible to query i iff
    #   i + seqlen_k - seqlen_q - window_left <= j <= i + seqlen_k - seqlen_q + window_right
    # (-1: no bound on that side; causal bounds the right side at 0 as well).
    window_left: int = -1
    window_right: int = -1
    softcap: float = 0.0  # > 0: the scaled score s becomes softcap * tanh(s / softcap); 0: off
    alibi: bool = False  # the scaled score gets -slope * |i + seqlen_k - seqlen_q - j| (slopes per batch, head)
    # flash-attn's varlen: sequences packed without padding, q (total_q, heads_q, d), k and v
    # (total_k, heads_kv, d), each sequence's rows and length read from cu_seqlens on the device
    varlen: bool = False
    # flash-attn's dropout_p > 0: P's entries are dropped by Philox4x32-10 of (seed, offset + batch · heads
    # + head, row, key) (``program_dropout``); the rate and the seed are arguments, so one module serves every rate
    dropout: bool = False
    # FlexAttention's score_mod and mask_mod, traced (``program_flex``): the score_mod acts on the scaled
    # score, the mask_mod joins the mask; their captured tensors are arguments. Alone: no other variant.
    flex: FlexMods | None = None
    # learnable attention sinks (gpt-oss's): a logit per query head, an argument, that joins each row's
    # softmax denominator as a key with no value (``initial_max``); the LSE includes it
    sinks: bool = False

    @property
    def transforms_score(self) -> bool:
        """Does the score change on its way into the softmax (softcap, ALiBi or a score_mod)? The
        programs then carry the logit itself (scaled) where they otherwise carry the unscaled q·k."""
        return self.softcap > 0 or self.alibi or (self.flex is not None and self.flex.score is not None)

    def __post_init__(self):
        if self.dtype not in (*SUPPORTED_DTYPES, FP8):
            raise ValueError(f"dtype: expected one of {(*SUPPORTED_DTYPES, FP8)}, got {self.dtype!r}")
        check_head_dim(self.head_dim)
        if self.heads_q < 1 or self.heads_kv < 1 or self.heads_q % self.heads_kv:
            raise ValueError(
                f"heads_q: expected a positive multiple of heads_kv={self.heads_kv}, got {self.heads_q}"
            )
        for name in ("window_left", "window_right"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < -1:
                raise ValueError(f"{name}: expected an int >= -1 (-1: no bound), got {value!r}")
        for name in ("varlen", "dropout", "sinks"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"{name}: expected True or False, got {getattr(self, name)!r}")
        if not (isinstance(self.softcap, (int, float)) and not isinstance(self.softcap, bool)
                and 0 <= self.softcap < math.inf):
            raise ValueError(f"softcap: expected a finite float >= 0 (0: off), got {self.softcap!r}")
        if self.flex is not None:
            if not isinstance(self.flex, FlexMods):
                raise TypeError(f"flex: expected a program_flex.FlexMods, got {type(self.flex).__name__}")
            others = [name for name, on in (("causal", self.causal), ("window", self.window_left >= 0 or
                      self.window_right >= 0), ("softcap", self.softcap > 0), ("alibi", self.alibi),
                      ("varlen", self.varlen), ("dropout", self.dropout)) if on]  # (sinks may join the mods)
            if others:
                raise ValueError(f"flex: a score_mod or mask_mod takes no other variant, got {others} too (write "
                                 "them into the mods)")
        if self.fp8:
            others = [name for name, on in (("window", self.window_left >= 0 or self.window_right >= 0),
                      ("softcap", self.softcap > 0), ("alibi", self.alibi), ("dropout", self.dropout),
                      ("flex", self.flex is not None), ("sinks", self.sinks)) if on]
            if others:
                raise NotImplementedError(f"dtype {FP8}: the FP8 forward takes causal, GQA and varlen only, got "
                                          f"{others}")
            if self.head_dim % FP8_HEAD_DIM_MULTIPLE:
                raise ValueError(f"dtype {FP8}: head_dim must be a multiple of {FP8_HEAD_DIM_MULTIPLE}, got "
                                 f"{self.head_dim}")

    @property
    def fp8(self) -> bool:
        """Are q, k and v e4m3 (FP8), with descales, and the output bf16?"""
        return self.dtype == FP8


def output_dtype(spec: AttentionSpec) -> str:
    """The output's dtype: the inputs', or bf16 for FP8 (FlashAttention-3's)."""
    return FP8_OUTPUT if spec.fp8 else spec.dtype


def rescale_threshold(spec: AttentionSpec) -> float:
    """How far past the running max a tile's max must be to move it (log2 units): ``RESCALE_THRESHOLD``, or 0
    with FP8. FP8 quantises P to e4m3 for P V: under a stale max a row's largest P is 2^f for a fraction f,
    which e4m3 rounds by up to 2^-4 of itself, and in a peaked row that key's error is the output's, several
    times the quantisation error of the smaller P. Moving the max whenever it grows keeps that P exactly 1."""
    return 0.0 if spec.fp8 else RESCALE_THRESHOLD


def fp8_arguments(spec: AttentionSpec, batch, heads_kv):
    """With FP8, three more parameters of the PrimFunc being parsed, last: ``q_descale``, ``k_descale``
    and ``v_descale``, float32 (batch, heads_kv), compact (FlashAttention-3's; varlen: batch the number of
    sequences); None without."""
    if not spec.fp8:
        return None
    descales = []
    for name in ("q_descale", "k_descale", "v_descale"):
        handle = T.arg(f"{name}_handle", T.handle())
        buffer = T.match_buffer(handle, (batch, heads_kv), "float32")
        IRBuilder.name(name, buffer)
        descales.append(buffer)
    return tuple(descales)


def fp8_v_shape(spec: AttentionSpec, batch, seqlen_k, heads_kv, head_dim):
    """V's shape: flash-attn's (batch, seqlen_k, heads_kv, head_dim), or with FP8 transposed, (batch,
    heads_kv, head_dim, keys) with keys contiguous (e4m3 wgmma reads both operands K-major, and P V sums
    over the keys) and ``keys`` a length of its own, at least the K/V tiles' rows the program visits,
    zero past seqlen_k (``attention_forward``: FP8's V tiles are read unmasked). varlen: (1, heads_kv,
    head_dim, keys), the packed sequences' keys, sequence b's from column ``fp8_v_first`` on, a tile past a
    sequence's end reading zeros and the next one's (P is 0 there, as where the sm90 TMA boxes read them)
    and the last one's padding."""
    if not spec.fp8:
        return (batch, seqlen_k, heads_kv, head_dim)
    keys = T.int32()
    IRBuilder.name("v_keys", keys)
    return (batch, heads_kv, head_dim, keys)


# FP8 varlen: where each sequence's keys start in the transposed V, a multiple of this many keys (bytes):
# the schedules copy V's rows 16 bytes at a time (cp.async), and a packed sequence may start at any key.
FP8_V_ALIGN = 16


def fp8_v_first(first_key, b):
    """The column of the transposed V where sequence b's keys start, varlen (``fp8_v_shape``): its first key
    (cu_seqlens_k[b]) rounded down to ``FP8_V_ALIGN``, plus FP8_V_ALIGN a sequence before it, so that it is
    aligned and past the sequence before's last key. TIR expressions, Python ints or torch tensors alike."""
    return FP8_V_ALIGN * (first_key // FP8_V_ALIGN + b)


def score_scale(spec: AttentionSpec, softmax_scale):
    """What the programs' running scores are in units of: softmax_scale, as the unscaled q·k are
    (the scale then fuses into exp2's argument), or 1 where the score is transformed and carried as
    the logit itself (``transformed_score``)."""
    return T.float32(1) if spec.transforms_score else softmax_scale


def transformed_score(spec: AttentionSpec, s, softmax_scale, slope, distance, flex=None, row=None, col=None):
    """The score that enters the softmax, in ``score_scale`` units: s (q·k, unscaled) itself, or
    with a softcap and/or ALiBi the logit softcap * tanh(s * scale / softcap) - slope * |distance|,
    distance = i + seqlen_k - seqlen_q - j (flash-attn's order: the bias is added after the cap:
    ``program_flex.builtin_score``, the trees a user's score_mod becomes), or with a score_mod (``flex``,
    a ``program_flex.FlexTile``) score_mod(s * scale, b, h, row, col)."""
    if not spec.transforms_score:
        return s
    if flex is not None:
        return flex.score(s, softmax_scale, row, col)
    return builtin_score(spec.softcap, spec.alibi).tir(s, softmax_scale, slope, distance, spec.dtype == "float32")


def softcap_gradient(spec: AttentionSpec, ds, s, softmax_scale, flex=None, row=None, col=None):
    """ds (the gradient of the logit) times the softcap's derivative 1 - tanh² at the score s (the
    softmax scale is applied with the rest at the gradients' store), or a score_mod's derivative
    (``flex``: d score_mod / d score at s * scale); ds itself without either."""
    if flex is not None:
        return flex.score_gradient(ds, s, softmax_scale, row, col)
    return builtin_score(spec.softcap, spec.alibi).gradient_tir(ds, s, softmax_scale, spec.dtype == "float32")


def alibi_slope(slopes, b, h):
    """The ALiBi slope of batch b, head h: ``slopes[b, h]``, or None without ALiBi (slopes None)."""
    return None if slopes is None else slopes[b, h]


def alibi_slopes_argument(spec: AttentionSpec, batch, heads):
    """With ALiBi, one more parameter of the PrimFunc being parsed, its slopes ``(batch, heads)``
    float32 with any batch stride (0: one row shared); None without. (TVMScript has no optional
    parameter: this adds it to the function's signature, after the others, only when it is used.)"""
    if not spec.alibi:
        return None
    handle = T.arg("alibi_slopes_handle", T.handle())
    stride = T.int32()
    IRBuilder.name("alibi_slopes_stride_b", stride)
    slopes = T.match_buffer(handle, (batch, heads), "float32", strides=(stride, 1))
    IRBuilder.name("AlibiSlopes", slopes)
    return slopes


def sinks_argument(spec: AttentionSpec, heads):
    """With sinks, one more parameter of the PrimFunc being parsed, after ALiBi's and dropout's: the
    sink logits ``(heads,)`` float32, compact; None without."""
    if not spec.sinks:
        return None
    handle = T.arg("sinks_handle", T.handle())
    sinks = T.match_buffer(handle, (heads,), "float32")
    IRBuilder.name("Sinks", sinks)
    return sinks


def sink_units(spec: AttentionSpec, sinks, h, softmax_scale):
    """Head h's sink logit in the running max's units (``score_scale``: the logit itself, or over
    softmax_scale where the scale fuses into exp2). The sink is a logit as it stands, never scaled, as in
    gpt-oss's reference: a column beside the scaled (capped, biased) scores."""
    if spec.transforms_score:
        return sinks[h]
    return sinks[h] / softmax_scale


def sink_buffer(spec: AttentionSpec):
    """With sinks, the tile's scalar (1,) float32 that holds its head's sink in the running max's units
    (block ``init_sink``; a scalar as the scale is, so that per-row blocks may read it); None without."""
    return T.sblock_alloc_buffer((1,), "float32") if spec.sinks else None


def initial_max(spec: AttentionSpec, sink):
    """The running max a row starts from: ``NO_MAX``, or with sinks the sink (``sink_buffer``) as a key
    already seen (no lower than NO_MAX, so a sink of -inf, no sink, stays finite and exp2 of it 0)."""
    if not spec.sinks:
        return T.float32(NO_MAX)
    return T.max(sink[0], T.float32(NO_MAX))


def initial_sum(spec: AttentionSpec, sink):
    """The running sum a row starts from: 0, or with sinks the sink's exp2(sink - max) = 1 (0 for a sink
    of -inf): a row that sees no key then gets 0 and an LSE of the sink, never NaN. (No comparison: the
    sm80/sm90 per-row intrinsic re-parses the block, and TVMScript prints a >= b back as b <= a.)"""
    if not spec.sinks:
        return T.float32(0)
    return T.exp2(sink[0] - initial_max(spec, sink))


@dataclass(frozen=True)
class Sequences:
    """Where a tile finds its sequence in the (batch, seqlen, heads, head_dim) arguments: batch
    ``batch``, from row ``first_q`` (``first_k`` for the keys; None: 0) on, ``seqlen_q`` and
    ``seqlen_k`` rows long. Dense: the tile's batch, whole. varlen: the one batch of packed rows,
    the offsets and lengths read from cu_seqlens."""

    batch: object
    seqlen_q: object
    seqlen_k: object
    first_q: object = None
    first_k: object = None

    def q_row(self, row):
        """The row of the (batch, seqlen_q, ...) views that is query ``row`` of the sequence."""
        return row if self.first_q is None else self.first_q + row

    def k_row(self, row):
        """The row of the (batch, seqlen_k, ...) views that is key ``row`` of the sequence."""
        return row if self.first_k is None else self.first_k + row


@dataclass(frozen=True)
class Packed:
    """varlen's extra parameters: cu_seqlens_q, cu_seqlens_k (batch + 1,) int32 and the longest
    sequence's length along the grid's rows (max_seqlen_q; the backward's dkdv: max_seqlen_k)."""

    cu_q: object
    cu_k: object
    max_seqlen: object

    @property
    def batch(self):
        return self.cu_q.shape[0] - 1


def varlen_arguments(spec: AttentionSpec, longest: str = "max_seqlen_q"):
    """With varlen, three more parameters of the PrimFunc being parsed, after softmax_scale:
    cu_seqlens_q and cu_seqlens_k, (batch + 1,) int32, and ``longest``, int32 (it sizes the grid);
    None without."""
    if not spec.varlen:
        return None
    cu_q_handle = T.arg("cu_seqlens_q_handle", T.handle())
    cu_k_handle = T.arg("cu_seqlens_k_handle", T.handle())
    max_seqlen = T.int32()
    IRBuilder.name(longest, max_seqlen)
    T.arg(longest, max_seqlen)
    boundaries = T.int32()
    IRBuilder.name("batch_plus_1", boundaries)
    cu_q = T.match_buffer(cu_q_handle, (boundaries,), "int32")
    IRBuilder.name("CuSeqlensQ", cu_q)
    cu_k = T.match_buffer(cu_k_handle, (boundaries,), "int32")
    IRBuilder.name("CuSeqlensK", cu_k)
    return Packed(cu_q, cu_k, max_seqlen)


def sequence_count(packed, batch):
    """How many sequences the grid covers: the batch, or varlen's len(cu_seqlens) - 1."""
    return batch if packed is None else packed.batch


def longest(packed, seqlen):
    """The rows the grid covers per sequence: seqlen, or varlen's max_seqlen argument."""
    return seqlen if packed is None else packed.max_seqlen


def runs_if(packed, b, first: int, keys: bool = False) -> dict:
    """A tile block's annotation (``RUNS_IF``) for a tile whose first query row (``keys``: key) is
    ``first``: none for the dense arguments, whose grid is their rows; varlen's grid covers the
    longest sequence's rows, and a tile past its own sequence's end runs nothing (flash-attn's early
    return): it writes nothing, and would load a tile of zeros and run masked steps for nothing."""
    if packed is None:
        return {}
    cu = packed.cu_k if keys else packed.cu_q
    return {RUNS_IF: first < cu[b + 1] - cu[b]}


def sequences(packed, b, seqlen_q, seqlen_k) -> Sequences:
    """Tile b's sequence: batch b of the dense arguments (packed None), or sequence b of the packed
    rows, cu_seqlens_q[b] .. cu_seqlens_q[b + 1] (and so for the keys)."""
    if packed is None:
        return Sequences(b, seqlen_q, seqlen_k)
    return Sequences(0, packed.cu_q[b + 1] - packed.cu_q[b], packed.cu_k[b + 1] - packed.cu_k[b],
                     packed.cu_q[b], packed.cu_k[b])


# Which keys a query sees (the forward's and the backward's rule; absolute positions, bottom-right
# aligned as flash-attn's): key j of seqlen_k, and with causal j <= i + seqlen_k - seqlen_q, and with
# a window i + seqlen_k - seqlen_q - window_left <= j <= i + seqlen_k - seqlen_q + window_right.
def right_bounds(spec: AttentionSpec, row, col, seqlen_q, seqlen_k) -> list:
    """The tests that key ``col`` is one of the keys and not past query ``row``'s right bound
    (causal's diagonal, a window's right edge). The bound only grows with the row."""
    tests = [col < seqlen_k]
    if spec.causal:
        tests.append(col <= row + seqlen_k - seqlen_q)
    if spec.window_right >= 0:
        tests.append(col <= row + seqlen_k - seqlen_q + spec.window_right)
    return tests


def sees_from(spec: AttentionSpec, row, col, seqlen_q, seqlen_k):
    """Is key ``col`` not before query ``row``'s left window edge (which grows with the row)? Only
    for a spec with a left window."""
    return col >= row + seqlen_k - seqlen_q - spec.window_left


def key_visible(spec: AttentionSpec, row, col, seqlen_q, seqlen_k):
    """Is key ``col`` visible to query ``row``? The tests are joined by a bitwise and, which
    evaluates every one: with a short-circuit ``&&`` NVVM may branch per score and recompute the
    row's bound in each branch (varlen, where the lengths come from cu_seqlens)."""
    tests = right_bounds(spec, row, col, seqlen_q, seqlen_k)
    if spec.window_left >= 0:
        tests.append(sees_from(spec, row, col, seqlen_q, seqlen_k))
    return functools.reduce(T.bitwise_and, tests)


def has_mask_mod(spec: AttentionSpec) -> bool:
    return spec.flex is not None and spec.flex.mask is not None


def flex_mask(spec: AttentionSpec, flex, row, col):
    """mask_mod's test of query ``row`` and key ``col`` (``flex``: the tile's ``program_flex.FlexTile``),
    to be joined to the built-in mask (``program_block_sparse.sparse_visible``), or None without a mask_mod."""
    if not has_mask_mod(spec):
        return None
    return flex.visible(row, col)


def block_visible(spec: AttentionSpec, first_row, last_row, first_col, last_col, seqlen_q, seqlen_k):
    """Does every query of rows first_row..last_row see every key of first_col..last_col? The
    first row's view of the last key decides the right bound, the last row's view of the first key
    the left window edge."""
    inside = functools.reduce(T.And, right_bounds(spec, first_row, last_col, seqlen_q, seqlen_k))
    if spec.window_left < 0:
        return inside
    return T.And(inside, sees_from(spec, last_row, first_col, seqlen_q, seqlen_k))


def first_kv_block(spec: AttentionSpec, qb, block_m, block_n, seqlen_q, seqlen_k):
    """The first K/V block (of ``block_n`` keys) Q block qb (of ``block_m`` rows) sees a key of: 0,
    or with a left window the block of its first row's first key."""
    if spec.window_left < 0:
        return 0
    return T.max(0, qb * block_m + seqlen_k - seqlen_q - spec.window_left) // block_n


def kv_blocks_end(spec: AttentionSpec, qb, block_m, block_n, seqlen_q, seqlen_k):
    """One past the last K/V block Q block qb sees a key of: the keys' end, or with causal or a
    right window the block of its last row's last visible key (0 where no row sees one)."""
    if not spec.causal and spec.window_right < 0:
        return T.ceildiv(seqlen_k, block_n)
    reach = (qb + 1) * block_m + seqlen_k - seqlen_q  # the last row's last visible key + 1
    if spec.window_right > 0 and not spec.causal:
        reach = reach + spec.window_right
    return T.ceildiv(T.min(seqlen_k, T.max(0, reach)), block_n)


def strided_argument(handle, shape, dtype: str, name: str):
    """A (batch, seqlen, heads, head_dim) tensor parameter of the PrimFunc being parsed, taken with any
    batch, sequence and head strides (int32 arguments ``{name}_stride_b``, ``_s``, ``_h``, in
    elements) and a contiguous head_dim: (b, s, h, d) tensors, (b, h, s, d) ones seen through a
    transpose and a packed qkv's thirds alike, without a copy. The strides are loop-invariant
    kernel arguments. Read it through ``aligned_strides``' view."""
    strides = (T.int32(), T.int32(), T.int32())
    for axis, stride in zip("bsh", strides):
        IRBuilder.name(f"{name}_stride_{axis}", stride)
    buffer = T.match_buffer(handle, shape, dtype, strides=(*strides, 1))
    IRBuilder.name(f"{name}_in", buffer)
    return buffer


def stride_multiple(stride_alignment: int, dtype: str) -> int:
    """``stride_alignment`` bytes in elements of ``dtype`` (at least 1)."""
    return max(1, stride_alignment * 8 // tvm.DataType(dtype).bits)


def aligned_strides(buffer, stride_alignment: int) -> tuple:
    """The strides of a ``strided_argument`` rounded down to a multiple of ``stride_alignment``
    bytes, for a view of it (``T.decl_buffer(..., data=buffer.data, strides=...)``): the caller
    passes only such strides, so the view is the argument, and CUDA code generation, which emits a
    16-byte vector load or store only where it can prove the index a multiple of the vector (a plain
    stride argument made gathers of scalar loads), sees it. The rounding costs two shifts a stride,
    out of every loop."""
    multiple = stride_multiple(stride_alignment, str(buffer.dtype))
    return (*(s if multiple == 1 else s // multiple * multiple for s in buffer.strides[:3]), 1)
