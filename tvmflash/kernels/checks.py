"""Every argument check of the kernels and their torch API: options (dtype, flags, softmax_scale, the
variant), tensors (types, shapes, dtypes, devices, strides, sizes), varlen's offsets and decode's
cache. Each error names the argument and says what was expected."""

from __future__ import annotations

import math
import numbers
import operator

import torch

from tvmflash import program
from tvmflash import target as targets
from tvmflash.program_block_sparse import SPARSE_ARGUMENTS

TORCH_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}
INT32_MAX = 2**31 - 1
# Splits a caller may ask of decode: the split kernel indexes tiles with split * tiles in int32.
MAX_SPLITS = 1024
# The variant fields of a spec (``program.AttentionSpec``): in a kernel's spec_args only where they are on,
# so that a kernel without them is named, cached and tuned as before they existed.
VARIANT_FIELDS = ("window_left", "window_right", "softcap", "alibi", "varlen", "dropout", "flex", "sinks")


# ----------------------------------------------------------------------------- options
def dtype_name(dtype) -> str:
    for name, torch_dtype in TORCH_DTYPES.items():
        if dtype in (name, torch_dtype):
            return name
    if dtype in (program.FP8, getattr(torch, program.FP8, None)):
        raise NotImplementedError("FP8 (e4m3): the forward alone, through flash_attn_func(q, k, v, q_descale=, "
                                  "k_descale=, v_descale=) or kernels.fp8.Fp8Kernel (sm90)")
    raise TypeError(f"dtype: expected one of {list(TORCH_DTYPES)} or the torch dtype, got {dtype!r}")


def resolve_softmax_scale(softmax_scale, head_dim: int) -> float:
    """The scale to use: 1/sqrt(head_dim) for None; a TypeError for anything but a finite number,
    a ValueError outside (0, program.MAX_SOFTMAX_SCALE]."""
    if softmax_scale is None:
        return 1.0 / math.sqrt(head_dim)
    if not isinstance(softmax_scale, (int, float)) or not math.isfinite(softmax_scale):
        raise TypeError(f"softmax_scale: expected a finite float, got {softmax_scale!r}")
    if not 0 < softmax_scale <= program.MAX_SOFTMAX_SCALE:
        raise ValueError(f"softmax_scale: expected a positive float up to {program.MAX_SOFTMAX_SCALE:g} (the "
                         f"kernel takes each row's max before scaling), got {softmax_scale!r}")
    return float(softmax_scale)


def check_any_head_dim(head_dim) -> int:
    """q's last dim at the torch API (``tvmflash.attention``, the flash_attn functions): 1 to
    ``program.MAX_HEAD_DIM``, which the API pads to a head_dim the kernels serve; else a ValueError
    naming it, before anything is computed (0 was a ZeroDivisionError, 1 / sqrt(head_dim))."""
    if not 1 <= head_dim <= program.MAX_HEAD_DIM:
        raise ValueError(f"head_dim: expected 1 to {program.MAX_HEAD_DIM} (q's last dim), got {head_dim}")
    return head_dim


def check_flag(name: str, value) -> bool:
    """A boolean option as a bool, in the forms flash-attn 2 takes (its C++ binding reads them as
    Python's truth): True or False, None (False), a number (``deterministic=1``) or a one-element
    tensor. A string (``causal="no"``, which flash-attn refuses too) or any other object is a
    TypeError, never read as its truth."""
    if value is None or isinstance(value, (bool, numbers.Number)):
        return bool(value)
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        return bool(value.item())
    raise TypeError(f"{name}: expected True or False (or None, a number, a one-element tensor), got {value!r}")


def window_pair(window_size) -> tuple[int, int]:
    """``window_size`` as (left, right) ints, in the forms flash-attn 2 takes: any sequence of two
    integers (a tuple, a list, a tensor, a numpy array; a bool is no integer here)."""
    try:
        pair = tuple(window_size)
        if len(pair) != 2 or any(isinstance(w, bool) for w in pair):
            raise TypeError
        return tuple(operator.index(w) for w in pair)
    except (TypeError, ValueError):
        raise TypeError(f"window_size: expected two ints (left, right), got {window_size!r}") from None


def resolve_variant(causal, window_size=(-1, -1), softcap=0.0, alibi=False, dropout=False, sinks=False) -> dict:
    """flash-attn's options, checked, as spec_args fields: ``causal`` and the variant fields that are
    on. As flash-attn: a window's right edge 0 is causal, and causal takes no other right edge; a
    bound of ``program.MAX_WINDOW`` or more is none (no sequence is that long). ``alibi`` and
    ``dropout``: whether the kernel takes slopes, a dropout rate and seed, at each call; ``sinks``: whether
    it takes sink logits."""
    causal = check_flag("causal", causal)
    sinks = check_flag("sinks", sinks)
    alibi = check_flag("alibi", alibi)
    dropout = check_flag("dropout", dropout)
    window_size = window_pair(window_size)
    if min(window_size) < -1:
        raise ValueError(f"window_size: expected ints >= -1 (-1: no bound on that side), got {tuple(window_size)}")
    left, right = (-1 if w >= program.MAX_WINDOW else w for w in window_size)
    if right == 0:
        causal = True
    if causal:
        right = -1
    if not isinstance(softcap, (int, float)) or isinstance(softcap, bool):
        raise TypeError(f"softcap: expected a float, got {softcap!r}")
    if not 0 <= softcap < math.inf:
        raise ValueError(f"softcap: expected a finite float >= 0 (0: off), got {softcap!r}")
    # each field with the value that means off: a window edge of 0 is on (left 0: no key before the diagonal)
    on = {"window_left": (left, -1), "window_right": (right, -1), "softcap": (float(softcap), 0.0),
          "alibi": (alibi, False), "dropout": (dropout, False), "sinks": (sinks, False)}
    return {"causal": causal, **{name: value for name, (value, off) in on.items() if value != off}}


def check_dropout_p(dropout_p) -> float:
    """flash-attn's ``dropout_p``: a float 0 <= p < 1 (the kept entries are scaled by 1 / (1 - p))."""
    if isinstance(dropout_p, bool) or not isinstance(dropout_p, numbers.Real):
        raise TypeError(f"dropout_p: expected a float, got {dropout_p!r}")
    if not 0 <= dropout_p < 1:
        raise ValueError(f"dropout_p: expected 0 <= dropout_p < 1, got {dropout_p!r}")
    return float(dropout_p)


def check_dropout_seed(seed, device) -> torch.Tensor:
    """The seed of a dropout call: flash-attn's rng_state, an int64 tensor (seed, offset) on ``device``."""
    if not isinstance(seed, torch.Tensor) or seed.dtype != torch.int64 or tuple(seed.shape) != (2,):
        raise ValueError("dropout_seed: expected an int64 tensor (seed, offset) of shape (2,), got "
                         + (f"{seed.dtype} {tuple(seed.shape)}" if isinstance(seed, torch.Tensor) else repr(seed)))
    if seed.device != device:
        raise ValueError(f"dropout_seed: expected device {device} (q's), got {seed.device}")
    return seed if seed.is_contiguous() else seed.contiguous()


def varlen_field(varlen) -> dict:
    """The spec_args field of varlen: {"varlen": True}, or none when off (dense kernels keep their keys)."""
    return {"varlen": True} if check_flag("varlen", varlen) else {}


def check_max_seqlen(name: str, value) -> int:
    """A max_seqlen argument: an int >= 0 (it sizes the grid on the host; torch.compile may trace it
    as a SymInt)."""
    if not isinstance(value, (int, torch.SymInt)) or isinstance(value, bool):
        raise TypeError(f"{name}: expected an int, got {value!r}")
    if value < 0:
        raise ValueError(f"{name}: expected an int >= 0, got {value}")
    return value


def check_num_splits(num_splits) -> None:
    if not isinstance(num_splits, int) or isinstance(num_splits, bool) or not 0 <= num_splits <= MAX_SPLITS:
        raise ValueError(f"num_splits: expected an int from 0 (automatic) to {MAX_SPLITS}, got {num_splits!r}")


# ----------------------------------------------------------------------------- tensors
def needs_int64(*tensors) -> bool:
    """Does any of the tensors (None: skipped) hold an element more than 2**31 - 1 elements past its
    first? Their modules then index in int64 (``lowering.wide_indices.WidenGlobalIndices``); smaller
    problems keep int32 modules, and their speed."""
    for t in tensors:
        if t is None or not t.numel():
            continue
        # a contiguous tensor's last element is numel - 1 past its first (the common case, and a C
        # call: this runs at every call of every kernel, a training step's included)
        last = t.numel() - 1 if t.is_contiguous() else sum((n - 1) * s for n, s in zip(t.shape, t.stride()))
        if last > INT32_MAX:
            return True
    return False


def check_strides(**tensors) -> None:
    """Every stride of each named tensor (None: skipped; of a dimension longer than 1) below 2**31:
    the modules take each stride and dimension as an int32 (only their sum of products, the offset,
    is computed in int64). Only tensors past 2**31 elements (``needs_int64``) can fail it."""
    for name, t in tensors.items():
        if t is not None and any(n > 1 and s > INT32_MAX for n, s in zip(t.shape, t.stride())):
            raise ValueError(f"{name}: strides of 2**31 elements or more are not supported (tensors of more than "
                             f"2**31 elements are, where one index of the first dim holds fewer), got shape "
                             f"{tuple(t.shape)}, strides {t.stride()}")


def alibi_slopes_view(alibi_slopes, batch: int, heads_q: int, device: torch.device) -> torch.Tensor:
    """``alibi_slopes`` (heads_q,) or (batch, heads_q), float32 on q's device, as the (batch, heads_q)
    view the programs read (one row for every batch: stride 0, no copy); a TypeError or ValueError
    that says what is wrong otherwise."""
    if not isinstance(alibi_slopes, torch.Tensor):
        raise TypeError(f"alibi_slopes: expected a float32 tensor (heads,) or (batch, heads), got "
                        f"{type(alibi_slopes).__name__}")
    if alibi_slopes.dtype != torch.float32:
        raise TypeError(f"alibi_slopes: expected dtype torch.float32, got {alibi_slopes.dtype}")
    if tuple(alibi_slopes.shape) not in ((heads_q,), (batch, heads_q)):
        raise ValueError(f"alibi_slopes: expected shape ({heads_q},) or ({batch}, {heads_q}) (heads or batch, heads), "
                         f"got {tuple(alibi_slopes.shape)}")
    if alibi_slopes.device != device:
        raise ValueError(f"alibi_slopes: expected device {device} (q's), got {alibi_slopes.device}")
    if alibi_slopes.dim() == 1:
        alibi_slopes = alibi_slopes[None].expand(batch, heads_q)
    return alibi_slopes if alibi_slopes.stride(1) == 1 else alibi_slopes.contiguous()


def sinks_view(sinks, heads_q: int, device: torch.device) -> torch.Tensor:
    """``sinks``, the sink logit of each query head: float32 (heads_q,) on q's device, compact (a copy
    where not); a TypeError or ValueError that says what is wrong otherwise."""
    if not isinstance(sinks, torch.Tensor):
        raise TypeError(f"sinks: expected a float32 tensor ({heads_q},) (one logit per query head), got "
                        f"{type(sinks).__name__}")
    if sinks.dtype != torch.float32:
        raise TypeError(f"sinks: expected dtype torch.float32, got {sinks.dtype}")
    if tuple(sinks.shape) != (heads_q,):
        raise ValueError(f"sinks: expected shape ({heads_q},) (one logit per query head), got {tuple(sinks.shape)}")
    if sinks.device != device:
        raise ValueError(f"sinks: expected device {device} (q's), got {sinks.device}")
    sinks = sinks.detach()  # (read by the modules through DLPack; its gradient is the backward's)
    return sinks if sinks.is_contiguous() else sinks.contiguous()


def cache_leftpad_view(cache_leftpad, batch: int, device: torch.device) -> torch.Tensor:
    """``cache_leftpad`` (flash-attn's), checked as flash-attn checks it: an int32 tensor (batch,),
    contiguous, on q's device; a TypeError or ValueError that says what is wrong otherwise. (Its
    values: ``check_cache_values``.)"""
    if not isinstance(cache_leftpad, torch.Tensor):
        raise TypeError(f"cache_leftpad: expected an int32 tensor ({batch},), got {type(cache_leftpad).__name__}")
    if cache_leftpad.dtype != torch.int32 or tuple(cache_leftpad.shape) != (batch,):
        raise ValueError(f"cache_leftpad: expected int32 of shape ({batch},), got {cache_leftpad.dtype} of shape "
                         f"{tuple(cache_leftpad.shape)}")
    if cache_leftpad.device != device:
        raise ValueError(f"cache_leftpad: expected device {device} (q's), got {cache_leftpad.device}")
    if not cache_leftpad.is_contiguous():
        raise ValueError(f"cache_leftpad: expected a contiguous tensor, got strides {cache_leftpad.stride()}")
    return cache_leftpad


def check_cu_seqlens(cu_seqlens_q, cu_seqlens_k, q, k, max_seqlen_q=None, max_seqlen_k=None) -> None:
    """cu_seqlens_q and cu_seqlens_k: contiguous int32 (batch + 1,) tensors on q's device, of one
    length. On the CPU also their values: non-decreasing from 0 to q's (k's; k None: any) row count, no sequence
    longer than max_seqlen_q (max_seqlen_k) where given (they size the grids: a longer sequence's
    rows past them would be left uncomputed); on CUDA reading them would wait for the device, so the
    kernel trusts the offsets there, as flash-attn's does, and the device asserts the lengths."""
    for name, cu, rows in (("cu_seqlens_q", cu_seqlens_q, q), ("cu_seqlens_k", cu_seqlens_k, k)):
        if not isinstance(cu, torch.Tensor):
            raise TypeError(f"{name}: expected an int32 tensor (batch + 1,), got {type(cu).__name__}")
        if cu.dtype != torch.int32:
            raise TypeError(f"{name}: expected dtype torch.int32, got {cu.dtype}")
        if cu.dim() != 1 or cu.shape[0] < 1:
            raise ValueError(f"{name}: expected shape (batch + 1,), got {tuple(cu.shape)}")
        if cu.device != q.device:
            raise ValueError(f"{name}: expected device {q.device} (q's), got {cu.device}")
        if cu.stride(0) != 1 and cu.shape[0] > 1:
            raise ValueError(f"{name}: expected a contiguous tensor, got stride {cu.stride(0)}")
        if cu.device.type == "cpu" and not torch.compiler.is_compiling():
            if cu[0] != 0 or (rows is not None and cu[-1] != rows.shape[0]):
                end = "" if rows is None else f" to {rows.shape[0]} (the packed rows)"
                raise ValueError(f"{name}: expected offsets from 0{end}, got {cu[0].item()} .. {cu[-1].item()}")
            if cu.shape[0] > 1 and bool((cu[1:] < cu[:-1]).any()):
                raise ValueError(f"{name}: expected non-decreasing offsets, got {cu.tolist()}")
    if cu_seqlens_q.shape != cu_seqlens_k.shape:
        raise ValueError(f"cu_seqlens_k: expected the shape of cu_seqlens_q {tuple(cu_seqlens_q.shape)} (one "
                         f"offset per sequence), got {tuple(cu_seqlens_k.shape)}")
    for name, cu, longest in (("cu_seqlens_q", cu_seqlens_q, max_seqlen_q),
                              ("cu_seqlens_k", cu_seqlens_k, max_seqlen_k)):
        if longest is None or torch.compiler.is_compiling() or cu.shape[0] < 2:
            continue
        if cu.device.type != "cpu":
            # Reading the lengths here would wait for the device: it checks them itself, and a sequence
            # longer than max_seqlen fails a device-side assertion (a CUDA error) instead of leaving rows
            # uncomputed, as flash-attn's kernel would
            torch._assert_async((cu[1:] - cu[:-1]).max() <= longest,
                                f"max_seqlen_{name[-1]}: expected at least the longest sequence's length in {name}")
            continue
        length = int((cu[1:] - cu[:-1]).max())
        if length > longest:
            raise ValueError(f"max_seqlen_{name[-1]}: expected at least the longest sequence's length in {name}, "
                             f"{length}, got {longest} (it sizes the grid: rows past it would be left uncomputed)")


def check_gradient_arguments(q, k, v, out, dout, lse, dlse, dq, dk, dv, rows) -> None:
    """The backward's: out and dout of q's shape and dtype, lse and dlse (None: 0) float32 of shape
    ``rows``, and dq, dk, dv (None: new) of q's, k's and v's and contiguous, all on q's device."""
    for name, t, shape, dtype in (("out", out, q.shape, q.dtype), ("dout", dout, q.shape, q.dtype),
                                  ("lse", lse, rows, torch.float32), ("dlse", dlse, rows, torch.float32),
                                  ("dq", dq, q.shape, q.dtype), ("dk", dk, k.shape, k.dtype),
                                  ("dv", dv, v.shape, v.dtype)):
        if t is None and name in ("dlse", "dq", "dk", "dv"):
            continue
        if not isinstance(t, torch.Tensor) or t.shape != shape or t.dtype != dtype or t.device != q.device:
            raise ValueError(f"{name}: expected a tensor of shape {tuple(shape)}, dtype {dtype} on {q.device}, got "
                             + (f"shape {tuple(t.shape)}, dtype {t.dtype} on {t.device}" if isinstance(t, torch.Tensor)
                                else type(t).__name__))
        if name in ("dq", "dk", "dv") and not t.is_contiguous():
            raise ValueError(f"{name}: expected a contiguous tensor, got strides {t.stride()}")


def fits_in_place(t, stride_multiple: int, cuda: bool) -> bool:
    """Can the module read or write ``t`` in place? Its last dim contiguous, its other strides
    multiples of ``stride_multiple`` elements (16 bytes on CUDA, any on the CPU)
    and, on CUDA, not 0 (a TMA tensor map's stride may not be) and its data 16-byte aligned. Its
    size is no condition: past 2**31 elements the call takes the module that indexes in int64
    (``needs_int64``; its strides must be below 2**31, ``check_strides``). (b, s, h, d) tensors,
    (b, h, s, d) ones seen through a transpose and a packed qkv's thirds all fit, for every
    supported head_dim."""
    n3, (s0, s1, s2, s3) = t.shape[3], t.stride()
    return ((s3 == 1 or n3 <= 1) and not (s0 % stride_multiple or s1 % stride_multiple or s2 % stride_multiple)
            and not (cuda and (t.data_ptr() % 16 or not (s0 and s1 and s2))))


class Arguments:
    """What the tensors of one kernel's calls must be (its head_dim, dtype, target, variant and
    stride multiple), with the checks and the in-place-or-copy rule that every kernel's call path
    shares. Plain values only: torch.compile traces no TVM object."""

    def __init__(self, head_dim: int, dtype: str, target, variant: dict | None = None, stride_multiple: int = 1):
        variant = variant or {}
        self.head_dim, self.dtype, self.stride_multiple = head_dim, dtype, stride_multiple
        # the variant's tensor arguments: ALiBi's slopes, dropout's rate and seed, decode's cache_leftpad
        self.alibi, self.dropout, self.leftpad, self.sinks = (variant.get(name, False)
                                                              for name in ("alibi", "dropout", "leftpad", "sinks"))
        self.flex = variant.get("flex")  # a score_mod's and mask_mod's captured tensors (program_flex.FlexMods)
        self.cuda, self.target_name = targets.is_cuda(target), targets.describe(target)
        self.device_type, self.torch_dtype = "cuda" if self.cuda else "cpu", TORCH_DTYPES[dtype]

    def check(self, q, k, v, out) -> None:
        """Types, shapes, dtypes and devices of a dense call (what torch.compile's fake tensors have
        too). The common case is one test (this runs at every call); ``explain`` says what is wrong."""
        want = self.torch_dtype
        try:
            qs, ks, device = q.shape, k.shape, q.device
            if (q.dtype is want and k.dtype is want and v.dtype is want and len(qs) == 4 and len(ks) == 4
                    and qs[3] == self.head_dim and ks == v.shape and ks[3] == self.head_dim and qs[0] == ks[0]
                    and ks[2] and not qs[2] % ks[2] and device.type == self.device_type and k.device == device
                    and v.device == device and (out is None or (isinstance(out, torch.Tensor) and out.shape == qs
                                                                and out.dtype is want and out.device == device))):
                return
        except (AttributeError, TypeError):
            pass
        self.explain(q, k, v, out)
        raise ValueError(f"q, k, v, out: unexpected arguments {q!r}, {k!r}, {v!r}, {out!r}")  # pragma: no cover

    def check_tensors(self, named, layout: str = "(batch, seqlen, heads, head_dim)", dims: int = 4) -> None:
        """Each (name, tensor) of ``named`` is a torch.Tensor of the kernel's dtype, with ``dims``
        dims (``layout``) and head_dim last; the last two (k and v) have one shape."""
        for name, t in named:
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
        want = self.torch_dtype
        for name, t in named:
            if t.dtype != want:
                raise TypeError(f"{name}: expected dtype {want} (the kernel was compiled for {self.dtype}), got {t.dtype}")
            if t.dim() != dims:
                raise ValueError(f"{name}: expected {dims} dims {layout}, got shape {tuple(t.shape)}")
            if t.shape[-1] != self.head_dim:
                raise ValueError(f"{name}: expected head_dim {self.head_dim} in the last dim, got shape {tuple(t.shape)}")
        (k_name, k), (v_name, v) = named[-2:]
        if k.shape != v.shape:
            raise ValueError(f"{v_name}: expected the shape of {k_name} {tuple(k.shape)}, got {tuple(v.shape)}")

    def explain(self, q, k, v, out) -> None:
        """Raise the error that says what is wrong with a dense call's arguments (``check``'s slow path)."""
        self.check_tensors([("q", q), ("k", k), ("v", v)])
        if q.shape[0] != k.shape[0]:
            raise ValueError(f"k: expected batch {q.shape[0]} (from q), got shape {tuple(k.shape)}")
        self.explain_heads_and_places(q, k, v, out, heads_dim=2)

    def explain_heads_and_places(self, q, k, v, out, heads_dim: int) -> None:
        """Raise the error that says what is wrong with the head counts (dim ``heads_dim``), the
        devices or out."""
        if k.shape[heads_dim] == 0 or q.shape[heads_dim] % k.shape[heads_dim]:
            raise ValueError(f"q: expected heads_q ({q.shape[heads_dim]}) to be a multiple of heads_kv "
                             f"({k.shape[heads_dim]})")
        for name, t in (("k", k), ("v", v)):
            if t.device != q.device:
                raise ValueError(f"{name}: expected device {q.device} (q's), got {t.device}")
        if q.device.type != self.device_type:
            raise ValueError(f"q: the kernel was built for {self.target_name}, got a tensor on {q.device}")
        if out is not None and (not isinstance(out, torch.Tensor) or out.shape != q.shape or out.dtype != q.dtype
                                or out.device != q.device):
            raise ValueError(f"out: expected a tensor of q's shape {tuple(q.shape)}, dtype and device, got "
                             f"{getattr(out, 'shape', out)!r}")

    def check_varlen(self, q, k, v, out, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k=None) -> None:
        """Types, shapes, dtypes and devices of a varlen call (what torch.compile's fake tensors have
        too); on the CPU the values of cu_seqlens as well (``check_cu_seqlens``; max_seqlen_k: where
        it sizes a grid, the backward's)."""
        self.check_tensors([("q", q), ("k", k), ("v", v)], "(total, heads, head_dim)", dims=3)
        self.explain_heads_and_places(q, k, v, out, heads_dim=1)
        check_max_seqlen("max_seqlen_q", max_seqlen_q)
        if max_seqlen_k is not None:
            check_max_seqlen("max_seqlen_k", max_seqlen_k)
        check_cu_seqlens(cu_seqlens_q, cu_seqlens_k, q, k, max_seqlen_q, max_seqlen_k)

    def variant_arguments(self, q, alibi_slopes, batch: int | None = None, dropout_p=None, dropout_seed=None,
                          cache_leftpad=None, captures=None, sinks=None) -> tuple:
        """The module's arguments after the others (decode's: after causal): the ALiBi slopes' (batch,
        heads_q) view if the kernel has ALiBi, then dropout's rate and seed if it has dropout
        (``dropout_arguments``), then decode's cache_leftpad if it has leftpad: each required where the
        kernel has it, refused where it has not. batch: q's first dim, heads_q its third, unless given
        (varlen's count of sequences; heads_q q's second). Then the sink logits if it has sinks
        (``sinks_arguments``), then a flex kernel's captured tensors (``flex_arguments``)."""
        return (self.alibi_arguments(q, alibi_slopes, batch) + self.dropout_arguments(q, dropout_p, dropout_seed)
                + self.leftpad_arguments(q, cache_leftpad)
                + self.sinks_arguments(q, sinks, q.shape[1] if batch is not None else q.shape[2])
                + self.flex_arguments(q, captures))

    def sinks_arguments(self, q, sinks, heads_q: int) -> tuple:
        """(sinks,) for a kernel with sinks, required; () without, where none may be given."""
        if not self.sinks:
            if sinks is not None:
                raise ValueError("sinks: this kernel was compiled without sinks (compile(..., sinks=True))")
            return ()
        if sinks is None:
            raise ValueError(f"sinks: this kernel was compiled with sinks: pass the sink logits, float32 ({heads_q},)")
        return (sinks_view(sinks, heads_q, q.device),)

    def flex_arguments(self, q, captures) -> tuple:
        """A flex kernel's captured tensors (``program_flex.FlexMods.captures``: their number, dtypes and
        dims), on q's device, compact (a copy where not), bool ones as their bytes (uint8); () without
        flex, where none may be given."""
        if self.flex is None:
            if captures:
                raise ValueError("captures: this kernel was compiled without a score_mod or mask_mod (compile(..., "
                                 "flex=...))")
            return ()
        captures = tuple(captures or ())
        # with block sparsity, the BlockMask's lists after them (``program_block_sparse.SPARSE_ARGUMENTS``)
        described = (*self.flex.captures, *((("int32", 4),) * len(SPARSE_ARGUMENTS) if self.flex.sparse else ()))
        if len(captures) != len(described):
            lists = f" and the {len(SPARSE_ARGUMENTS)} block-sparse lists" if self.flex.sparse else ""
            raise ValueError(f"captures: this kernel's mods read {len(self.flex.captures)} captured tensors{lists}, got "
                             f"{len(captures)}")
        usable = []
        for n, (t, (dtype, ndim)) in enumerate(zip(captures, described)):
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"captures[{n}]: expected a torch.Tensor, got {type(t).__name__}")
            if t.dtype is not getattr(torch, dtype) or t.dim() != ndim:
                raise ValueError(f"captures[{n}]: expected a {ndim}-dim {dtype} tensor (as when the mods were "
                                 f"traced), got a {t.dim()}-dim {t.dtype} one")
            if t.device != q.device:
                raise ValueError(f"captures[{n}]: expected q's device {q.device}, got {t.device}")
            if not t.numel():
                raise ValueError(f"captures[{n}]: expected a tensor with elements, got shape {tuple(t.shape)}")
            t = t.contiguous()
            usable.append(t.view(torch.uint8) if t.dtype == torch.bool else t)
        return tuple(usable)

    def alibi_arguments(self, q, alibi_slopes, batch: int | None) -> tuple:
        if not self.alibi:
            if alibi_slopes is not None:
                raise ValueError("alibi_slopes: this kernel was compiled without ALiBi (compile(..., alibi=True))")
            return ()
        if alibi_slopes is None:
            raise ValueError("alibi_slopes: this kernel was compiled with ALiBi: pass the slopes, (heads,) or "
                             "(batch, heads) float32")
        if batch is None:
            return (alibi_slopes_view(alibi_slopes, q.shape[0], q.shape[2], q.device),)
        return (alibi_slopes_view(alibi_slopes, batch, q.shape[1], q.device),)

    def leftpad_arguments(self, q, cache_leftpad) -> tuple:
        if not self.leftpad:
            if cache_leftpad is not None:
                raise ValueError("cache_leftpad: this kernel was compiled without leftpad (compile_decode(..., "
                                 "leftpad=True))")
            return ()
        if cache_leftpad is None:
            raise ValueError("cache_leftpad: this kernel was compiled with leftpad: pass cache_leftpad, (batch,) int32")
        return (cache_leftpad_view(cache_leftpad, q.shape[0], q.device),)

    def dropout_arguments(self, q, dropout_p, dropout_seed) -> tuple:
        """(dropout_p, dropout_seed) for a kernel with dropout, both required: a float 0 <= p < 1 and
        flash-attn's rng_state, int64 (seed, offset) on q's device (``dropout_seed``); () without dropout, where neither may be
        given (a rate of 0 may)."""
        if not self.dropout:
            if dropout_seed is not None or (dropout_p is not None and dropout_p != 0):
                raise ValueError("dropout_p: this kernel was compiled without dropout (compile(..., dropout=True))")
            return ()
        if dropout_p is None or dropout_seed is None:
            raise ValueError("dropout_p, dropout_seed: this kernel was compiled with dropout: pass the rate and "
                             "the seed (tvmflash.dropout.philox_state draws one)")
        return check_dropout_p(dropout_p), check_dropout_seed(dropout_seed, q.device)

    def fits(self, t) -> bool:
        """Can the module read or write ``t`` in place? (``fits_in_place``)"""
        return fits_in_place(t, self.stride_multiple, self.cuda)

    def usable(self, t, name: str, copy: bool = True):
        """``t`` itself where the module can read it in place (``fits``), else a compact copy (strides
        that are no whole 16-byte vectors on CUDA), else a ValueError that says why."""
        if not t.numel() or self.fits(t):
            return t
        if t.shape[3] > 1 and t.stride(3) != 1 and name != "out":
            raise ValueError(f"{name}: expected a contiguous last dim (stride 1), got strides {t.stride()}")
        if self.cuda and t.data_ptr() % 16 and name != "out":
            raise ValueError(f"{name}: expected a 16-byte aligned data pointer, got {t.data_ptr():#x}")
        return t.clone(memory_format=torch.contiguous_format) if copy else t

    def readable(self, t, strided: bool = True):
        """The backward's: ``t`` itself where the programs can read it in place, else a compact copy.
        q, k and v (``strided``) are read through their strides (``fits``: a packed qkv's thirds, a
        transposed (b, h, s, d) tensor); out, dout and lse must be compact. A CUDA tensor whose
        data is off the 16 bytes vector loads need is copied too."""
        fits = self.fits(t) if strided else t.is_contiguous() and not (self.cuda and t.data_ptr() % 16)
        return t if fits or not t.numel() else t.clone(memory_format=torch.contiguous_format)

    def check_decode(self, page_size: int, q, k_cache, v_cache, lengths, index, out, cache_dtype=None) -> None:
        """A decode call's tensors (see ``DecodeKernel``): q, the caches (``page_size`` rows a page,
        0: contiguous; of ``cache_dtype``, None: q's), the lengths, the cache rows or block table, and
        out (None: new)."""
        for name, t in (("cache_seqlens", lengths), ("block_table" if page_size else "cache_batch_idx", index)):
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
        layout = "(pages, page_size, heads, head_dim)" if page_size else "(batch, seqlen, heads, head_dim)"
        if cache_dtype is None:
            self.check_tensors([("q", q), ("k_cache", k_cache), ("v_cache", v_cache)], layout)
        else:  # q in the kernel's dtype, the caches in their own
            self.check_tensors([("q", q), ("q", q)], layout)
            for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
                if not isinstance(t, torch.Tensor) or t.dtype != cache_dtype:
                    raise TypeError(f"{name}: expected a {cache_dtype} cache, got {getattr(t, 'dtype', type(t).__name__)}")
                if t.dim() != 4 or t.shape[-1] != self.head_dim:
                    raise ValueError(f"{name}: expected 4 dims {layout} with head_dim {self.head_dim}, got shape "
                                     f"{tuple(t.shape)}")
            if k_cache.shape != v_cache.shape:
                raise ValueError(f"v_cache: expected the shape of k_cache {tuple(k_cache.shape)}, got "
                                 f"{tuple(v_cache.shape)}")
        heads_kv = k_cache.shape[2]
        if heads_kv == 0 or q.shape[2] % heads_kv:
            raise ValueError(f"q: expected heads_q ({q.shape[2]}) to be a multiple of the cache's heads_kv ({heads_kv})")
        if page_size and k_cache.shape[1] != page_size:
            raise ValueError(f"k_cache: expected pages of {page_size} rows (num_pages, page_size, heads_kv, "
                             f"head_dim), got shape {tuple(k_cache.shape)}")
        batch = q.shape[0]
        index_shape = "(batch, pages_per_seq)" if page_size else "(batch,)"
        index_name = "block_table" if page_size else "cache_batch_idx"
        if lengths.dtype != torch.int32 or lengths.shape != (batch,):
            raise ValueError(f"cache_seqlens: expected int32 of shape ({batch},), got {lengths.dtype} of shape "
                             f"{tuple(lengths.shape)}")
        if index.dtype != torch.int32 or index.dim() != (2 if page_size else 1) or index.shape[0] != batch:
            raise ValueError(f"{index_name}: expected int32 of shape {index_shape} with batch {batch}, got "
                             f"{index.dtype} of shape {tuple(index.shape)}")
        for name, t in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache), ("cache_seqlens", lengths),
                        (index_name, index)):
            if t.device != q.device:
                raise ValueError(f"{name}: expected device {q.device} (q's), got {t.device}")
            if needs_int64(t):  # more than 2**31 elements: an int64 module (``DecodeKernel.__call__``)
                check_strides(**{name: t})
        if q.device.type != self.device_type:
            raise ValueError(f"q: the kernel was built for {self.target_name}, got a tensor on {q.device}")
        for name, t in (("k_cache", k_cache), ("v_cache", v_cache), ("cache_seqlens", lengths), (index_name, index)):
            if not t.is_contiguous():  # the cache is written in place: never copied behind the caller's back
                raise ValueError(f"{name}: expected a contiguous tensor, got strides {t.stride()}")
        if q.numel() and q.stride(3) != 1:
            raise ValueError(f"q: expected a contiguous last dim (stride 1), got strides {q.stride()}")
        if self.cuda:
            for name, t in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache)):
                if t.data_ptr() % 16:
                    raise ValueError(f"{name}: expected a 16-byte aligned data pointer, got {t.data_ptr():#x}")
        if out is not None and (not isinstance(out, torch.Tensor) or out.shape != q.shape or out.dtype != q.dtype
                                or out.device != q.device or not out.is_contiguous()):
            raise ValueError(f"out: expected a contiguous tensor of q's shape {tuple(q.shape)}, dtype and device, got "
                             f"{getattr(out, 'shape', out)!r}")


# ----------------------------------------------------------------------------- flash-attn's functions


def check_descale(name: str, descale, batch: int, heads_kv: int, device) -> torch.Tensor:
    """A descale of FP8 tensors (FA3's q_descale, k_descale, v_descale; an FP8 cache's): float32 (batch, heads_kv) on ``device``, compact (a copy if not);
    None: ones."""
    if descale is None:
        return torch.ones((batch, heads_kv), dtype=torch.float32, device=device)
    if not isinstance(descale, torch.Tensor) or descale.dtype != torch.float32:
        raise TypeError(f"{name}: expected a float32 tensor of shape ({batch}, {heads_kv}), got "
                        f"{getattr(descale, 'dtype', type(descale).__name__)}")
    if tuple(descale.shape) != (batch, heads_kv):
        raise ValueError(f"{name}: expected shape (batch, heads_kv) = ({batch}, {heads_kv}), got {tuple(descale.shape)}")
    if descale.device != device:
        raise ValueError(f"{name}: expected a tensor on {device}, got {descale.device}")
    return descale.contiguous()
