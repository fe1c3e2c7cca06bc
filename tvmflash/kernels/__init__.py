"""The kernels: the attention programs compiled for a target, cached, and called on torch tensors.

``compile`` (the forward, dense or varlen), ``compile_backward`` and ``compile_decode`` make (or find)
a kernel. Each kernel owns a ``build.Build`` (its cache key, modules in memory and on disk), gets its
schedule and knobs from ``tvmflash.choice``, and checks its arguments with ``checks``.
"""

from __future__ import annotations

from tvmflash import cache, choice, program
from tvmflash import target as targets
from tvmflash.kernels import fp8, registry
from tvmflash.kernels.backward import BackwardKernel, VarlenBackwardKernel
from tvmflash.kernels.checks import check_flag, dtype_name, resolve_variant, varlen_field
from tvmflash.kernels.decode import DecodeKernel
from tvmflash.kernels.forward import Kernel, kernel_key
from tvmflash.kernels.registry import by_key
from tvmflash.kernels.varlen import VarlenKernel
from tvmflash.program_decode import DecodeSpec
from tvmflash.program_flex import FlexMods

__all__ = ["BackwardKernel", "DecodeKernel", "Kernel", "VarlenBackwardKernel", "VarlenKernel", "by_key", "compile",
           "compile_backward", "compile_decode", "compile_fp8", "forget_kernels"]

_KERNELS: dict[str, Kernel | BackwardKernel] = {}  # compile()'s and compile_backward()'s, by key
_DECODE_KERNELS: dict[str, DecodeKernel] = {}  # compile_decode()'s, by key


def compile(*, head_dim: int, dtype, causal: bool = False, target=None, knobs: dict | None = None,
            heads_q: int | None = None, heads_kv: int | None = None, window_size=(-1, -1), softcap: float = 0.0,
            alibi: bool = False, varlen: bool = False, dropout: bool = False,
            schedule: str | None = None, flex=None, sinks: bool = False) -> Kernel:  # noqa: A001
    """Compile FlashAttention forward and return a :class:`Kernel`.

    head_dim: a multiple of 8 up to 256 that a schedule for the target serves (each declares its own:
    ``tvmflash.choice.native_head_dims``; a ValueError names them otherwise; ``tvmflash.attention`` pads
    any head_dim from 1 to 256 to one of them). dtype: "float16", "bfloat16", "float32" or the torch dtype.
    causal, window_size, softcap: flash-attn's (``resolve_variant``; one kernel per value); alibi:
    the kernel takes ALiBi slopes at each call; dropout: it takes flash-attn's dropout_p and a seed at
    each call (``Kernel``); sinks: it takes a sink logit per query head at each call (gpt-oss's
    learnable sinks, float32 (heads_q,), in each row's softmax denominator); flex: a ``program_flex.FlexMods`` (``tvmflash.flex_trace.trace_mods``), a
    score_mod and mask_mod compiled into the program, whose captured tensors each call takes
    (``captures=``); varlen: a :class:`VarlenKernel`, over sequences packed
    without padding (flash-attn's varlen). target: None (the current torch CUDA device if there
    is one, else the CPU), "cpu", "cuda", "sm80", "sm86", "sm89", "sm90", "sm100", "sm120", a
    ``tvm.target.Target`` or a JSON dict. schedule: the name of the schedule to use ("sm90", "sm80",
    "simt", "cpu"; None: ``tvmflash.choice`` picks). knobs: overrides of that schedule's forward knobs
    (``kernel.info()["knobs"]``; each schedule declares them in its ``knobs``). heads_q / heads_kv:
    build for these head counts now; otherwise each new head count is built at its first call.

    Modules are cached in memory and on disk (``$TVMFLASH_CACHE_DIR``, else ``~/.cache/tvmflash``).
    """
    dtype = dtype_name(dtype)
    variant = {**resolve_variant(causal, window_size, softcap, alibi, dropout, sinks), **varlen_field(varlen),
               **flex_field(flex)}
    program.AttentionSpec(head_dim, dtype, **variant)  # validates head_dim and dtype
    resolved = targets.resolve(target)
    # The environment's settings are in the key: they may change the schedule for the same target.
    # The records that choice reads are read once, when the Kernel is made (as its tuned knobs are):
    # compile() runs on every tvmflash.attention call, so a cached one reads no file.
    spec_args = {"head_dim": head_dim, "dtype": dtype, **variant}
    key = kernel_key(spec_args, resolved, knobs, schedule)
    kernel = _KERNELS.get(key)
    if kernel is None:
        kernel = _KERNELS[key] = (VarlenKernel if varlen else Kernel)(spec_args, resolved, knobs, schedule)
    if heads_q is not None:
        kernel.module(heads_q, heads_kv if heads_kv is not None else heads_q)
    return kernel


def compile_backward(*, head_dim: int, dtype, causal: bool = False, target=None, knobs: dict | None = None,
                     heads_q: int | None = None, heads_kv: int | None = None, window_size=(-1, -1),
                     softcap: float = 0.0, alibi: bool = False, varlen: bool = False, dropout: bool = False,
                     deterministic: bool = False, schedule: str | None = None, flex=None) -> BackwardKernel:
    """Compile the FlashAttention backward and return a :class:`BackwardKernel` (varlen: a
    :class:`VarlenBackwardKernel`). The arguments are :func:`compile`'s; knobs override the
    schedule's backward knobs. deterministic: gradients bitwise the same from run to run (dq by
    a program of its own even where the schedule's default sums it by atomics, the knob ``dq_atomic``)."""
    dtype = dtype_name(dtype)
    deterministic = check_flag("deterministic", deterministic)
    variant = {**resolve_variant(causal, window_size, softcap, alibi, dropout), **varlen_field(varlen),
               **flex_field(flex)}
    program.AttentionSpec(head_dim, dtype, **variant)  # validates head_dim and dtype
    resolved = targets.resolve(target)
    spec_args = {"head_dim": head_dim, "dtype": dtype, **variant}
    key = cache.digest(["backward", spec_args, str(resolved), knobs, schedule, choice.environment("backward"),
                        deterministic])
    kernel = _KERNELS.get(key)
    if kernel is None:
        kernel = _KERNELS[key] = (VarlenBackwardKernel if varlen else BackwardKernel)(spec_args, resolved, knobs,
                                                                                      deterministic, schedule)
    if heads_q is not None:
        kernel.module(heads_q, heads_kv if heads_kv is not None else heads_q)
    return kernel


def flex_field(flex) -> dict:
    """The spec field of ``compile``'s flex (a ``program_flex.FlexMods``), only where given."""
    if flex is None:
        return {}
    if not isinstance(flex, FlexMods):
        raise TypeError(f"flex: expected a program_flex.FlexMods (tvmflash.flex_trace.trace_mods), got "
                        f"{type(flex).__name__}")
    return {"flex": flex}


def compile_decode(*, head_dim: int, dtype, page_size: int = 0, target=None, knobs: dict | None = None,
                   heads_q: int | None = None, heads_kv: int | None = None, window_size=(-1, -1),
                   softcap: float = 0.0, alibi: bool = False, leftpad: bool = False,
                   schedule: str | None = None, sinks: bool = False, cache_dtype=None) -> DecodeKernel:
    """Compile Flash-Decoding and return a :class:`DecodeKernel` (cached in memory; modules on disk).

    page_size: 0 for a contiguous cache, else the paged cache's rows per page (a power of two >= 16).
    target, knobs: as ``tvmflash.compile`` (knobs of the schedule's decode). heads_q / heads_kv: build
    for these head counts now. window_size, softcap, alibi: as ``tvmflash.compile``'s, but a window's
    right edge 0 is no window: that is the call's ``causal``. leftpad: each call takes flash-attn's
    ``cache_leftpad``, int32 (batch,), the cache row of each sequence's first key (a contiguous cache
    only, as flash-attn's). sinks: each call takes a sink logit per query head (float32 (heads_q,)), which
    joins the merge of the splits once. schedule: "sm80" (tensor cores), "simt" or "cpu"; None: TVMFLASH_DECODE,
    else the target's (``tvmflash.choice``). cache_dtype: None for a cache in ``dtype``, or
    torch.float8_e4m3fn ("float8_e4m3fn"): an FP8 cache, each call taking k_descale and v_descale
    (``DecodeKernel``; dtype fp16 or bf16).
    """
    dtype = dtype_name(dtype)
    variant = {**resolve_variant(False, window_size, softcap, alibi, sinks=sinks),
               **({"leftpad": True} if check_flag("leftpad", leftpad) else {})}  # a field only when on
    if cache_dtype is not None:
        cache_dtype = str(cache_dtype).removeprefix("torch.")  # a torch dtype or its name (DecodeSpec checks it)
        if cache_dtype != dtype:  # (a cache in q's dtype is the plain kernel)
            variant["cache_dtype"] = cache_dtype
    if variant.pop("causal"):
        raise ValueError(f"window_size: a right edge of 0 is causal, an argument of each call: pass causal=True and "
                         f"window_size=({variant.get('window_left', -1)}, -1)")
    DecodeSpec(head_dim, dtype, 1, 1, page_size, **variant)  # validates head_dim, dtype and page_size
    resolved = targets.resolve(target)
    key = cache.digest([head_dim, dtype, page_size, str(resolved), knobs, variant, schedule,
                        choice.environment("decode")])
    kernel = _DECODE_KERNELS.get(key)
    if kernel is None:
        kernel = _DECODE_KERNELS[key] = DecodeKernel(head_dim, dtype, page_size, resolved, knobs, variant, schedule)
    if heads_q is not None:
        kernel.module(heads_q, heads_kv if heads_kv is not None else heads_q)
    return kernel


def compile_fp8(*, head_dim: int, causal: bool = False, target=None, knobs: dict | None = None,
                schedule: str | None = None, heads_q: int | None = None, heads_kv: int | None = None,
                varlen: bool = False) -> fp8.Fp8Kernel:
    """The FP8 (e4m3) forward's kernel (``kernels.fp8.Fp8Kernel``; varlen: ``Fp8VarlenKernel``), cached in
    memory (modules on disk). knobs: as ``tvmflash.compile``'s (of the schedule's ``Fp8Forward.knobs``; None:
    this GPU's tuning record's or the defaults). heads_q / heads_kv: build for these head counts now."""
    kernel = fp8.fp8_kernel(head_dim, causal, target, schedule, varlen, knobs)
    if heads_q is not None:
        kernel.build.module(heads_q, heads_kv if heads_kv is not None else heads_q)
    return kernel


def forget_kernels() -> None:
    """Drop the in-memory kernels (and the caches above that hold them), so the next ``compile()``,
    ``compile_backward()`` or ``compile_decode()`` looks up tuned knobs afresh (after ``tvmflash
    tune`` wrote new ones). Built modules stay cached."""
    _KERNELS.clear()
    _DECODE_KERNELS.clear()
    fp8.forget()
    registry.forget()
