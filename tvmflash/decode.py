"""Decode over a KV cache (Flash-Decoding): ``flash_attn_with_kvcache`` and the kernel behind it.

``DecodeKernel`` builds the two programs of ``tvmflash.program_decode`` (the split kernel and the
merge) into one module per (head counts, cache layout), cached in memory and on disk as the forward's
``Kernel`` (whose machinery it shares), and calls them on torch tensors through DLPack.
``flash_attn_with_kvcache`` is flash-attn 2's API on top of it: it appends new keys and values to the
cache in place, picks the split count, and returns the output (and the LSE).
"""

from __future__ import annotations

import functools
import math
import os

import torch
import tvm

from tvmflash import cache, database, lowering, program, program_decode
from tvmflash import schedules as schedule_registry
from tvmflash import target as targets
from tvmflash.kernel import (
    Kernel,
    build_options,
    check_strides,
    dtype_name,
    needs_int64,
    resolve_softmax_scale,
    resolve_variant,
)
from tvmflash.program_decode import DecodeSpec

# num_splits=0 never picks more splits than this (each split adds a partial output to write and merge;
# flash-attn's cap): a lone sequence needs about 100 splits to give each SM's six one-warp tasks work.
MAX_AUTO_SPLITS = 128
# Splits a caller may ask for: the split kernel indexes tiles with split * tiles in int32.
MAX_SPLITS = 1024
_INT32_MAX = 2**31 - 1


class DecodeKernel(Kernel):
    """Flash-Decoding for one (head_dim, dtype, cache layout, variant, target).

    Call it on torch tensors (checked; see ``program_decode`` for the layouts)::

        out, lse = kernel(q, k_cache, v_cache, lengths, index, num_splits=4)

    q: (batch, seqlen_q, heads_q, head_dim); k_cache, v_cache: (cache_batch, cache_len, heads_kv,
    head_dim) contiguous, or (num_pages, page_size, heads_kv, head_dim) paged; lengths: int32
    (batch,), the keys each sequence attends to; index: int32, the cache row of each sequence
    (batch,), or the block table (batch, pages_per_seq) when paged. out has q's shape and dtype, lse
    is float32 (batch, heads_q, seqlen_q). Lengths are read on the device: every length, batch,
    seqlen_q and split count runs the same module, and a call captured in a CUDA graph replays with
    the lengths the tensor holds then. causal is an argument of the call, not of the module. Each new
    pair of head counts builds (or loads) one module, with the functions ``split`` and ``merge`` (and
    ``single``, which num_splits=1 runs alone: it writes the output, with no merge); a cache of more
    than 2**31 elements one more, that indexes in int64 (``kernel.needs_int64``).
    The variant (a window, a softcap, ALiBi: ``compile_decode``) is the kernel's; with ALiBi each call
    takes ``alibi_slopes``, float32 (heads_q,) or (batch, heads_q).
    """

    PASS = "decode"

    def __init__(self, head_dim: int, dtype: str, page_size: int, target: tvm.target.Target, knobs: dict | None,
                 variant: dict | None = None, schedule: str | None = None):
        self._set_problem({"head_dim": head_dim, "dtype": dtype, "causal": False, **(variant or {})}, target)
        self.page_size = page_size
        # sm80's tensor cores on sm80+ GPUs (fp16/bf16), else SIMT threads, or the CPU's schedule
        self.schedule = schedule_registry.decode_for_target(target, dtype, head_dim, schedule)
        # the program variant the schedule maps: operands in q's dtype for tensor cores, else float32
        self.tensor_cores = getattr(self.schedule, "DECODE_TENSOR_CORES", False)
        self.schedule_source = "the target's"
        self._check_knob_names(knobs, self.schedule.DECODE_KNOBS, "decode ")
        # the caller's knobs, else those `tvmflash tune --pass decode` stored for this device and cache
        # layout, else the defaults
        tuned = None if knobs else database.lookup(target, schedule_registry.name_of(self.schedule),
                                                   decode_workload(head_dim, dtype, page_size))
        self._take_knobs(self.schedule.DECODE_KNOBS, tuned, knobs)
        problem = getattr(self.schedule, "decode_knob_problem", lambda *a: None)(head_dim, dtype, self.knobs)
        if problem:
            raise ValueError(f"knobs: {problem}")
        limit = target.attrs.get("max_shared_memory_per_block") if targets.is_cuda(target) else None
        need = self.schedule.decode_shared_memory_bytes(head_dim, dtype, self.knobs) if limit else 0
        if limit and need > int(limit):
            raise ValueError(f"knobs: {self.knobs} need {need / 1024:.0f} KiB of shared memory, "
                             f"{targets.describe(target)} allows {int(limit) / 1024:.0f} KiB; try a smaller block_n")
        self._modules = {}
        self._last = None
        self._rows: dict[tuple[int, torch.device], torch.Tensor] = {}  # arange(batch) per device: cache rows

    # ----------------------------------------------------------------- building (Kernel's, with these)
    def _spec(self, heads_q: int, heads_kv: int) -> DecodeSpec:
        return DecodeSpec(self.head_dim, self.dtype, heads_q, heads_kv, self.page_size, **self.variant)

    def _code(self) -> str:
        return cache.source_digest(program, program_decode, self.schedule, schedule_registry.common,
                                   schedule_registry.simt, *lowering.MODULES)  # simt: the merge's schedule

    def _key(self, spec: DecodeSpec, wide: bool = False) -> str:
        return cache.digest({"pass": self.PASS, "like the forward's": super()._key(spec, wide),
                             "tensor cores": self.tensor_cores})

    def _scheduled(self, spec: DecodeSpec) -> tvm.s_tir.Schedule:
        """The programs in one module, scheduled: ``split`` and ``merge``, and ``single`` (the split
        program as one split writing the output itself: no merge, no partial buffers)."""
        split, single = (program_decode.decode_split(spec, self.query_tokens(spec.group), self.knobs["block_n"],
                                                     final=final, tensor_cores=self.tensor_cores)
                         for final in (False, True))
        merge = program_decode.decode_merge(spec)
        mod = tvm.IRModule({"split": split.with_attr("global_symbol", "split"),
                            "single": single.with_attr("global_symbol", "single"),
                            "merge": merge.with_attr("global_symbol", "merge")})
        return self.schedule.schedule_decode(tvm.s_tir.Schedule(mod), **self.knobs)

    def _build_options(self) -> dict:
        return {**build_options(self.schedule), "pass_config": getattr(self.schedule, "DECODE_PASS_CONFIG", {})}

    def _entry(self, module):
        return {"split": module["split"], "single": module["single"], "merge": module["merge"]}

    def info(self) -> dict:
        return {**super().info(), "pass": self.PASS, "causal": "per call", "page_size": self.page_size}

    def __repr__(self) -> str:
        layout = f"paged {self.page_size}" if self.page_size else "contiguous"
        variant = "".join(f"{name}={value!r}, " for name, value in self.variant.items())
        return (f"tvmflash.DecodeKernel(head_dim={self.head_dim}, dtype={self.dtype}, {layout}, {variant}"
                f"target={targets.describe(self.target)!r})")

    def query_tokens(self, group: int) -> int:
        """Query tokens of a task, for a GQA group of ``group`` query heads (the tensor-core schedule fills
        whole mma tiles of rows; the others take the knob)."""
        rule = getattr(self.schedule, "decode_query_tokens", None)
        return rule(group, self.knobs) if rule else self.knobs["query_tokens"]

    def query_blocks(self, seqlen_q: int, group: int) -> int:
        return -(-seqlen_q // self.query_tokens(group))

    def auto_num_splits(self, batch: int, heads_kv: int, seqlen_q: int, max_keys: int, device: torch.device,
                        group: int = 8) -> int:
        """The split count for ``num_splits=0``, from static shapes only (so that a CUDA graph's
        buffers fit every replay): enough tasks to fill the device (``choose_num_splits``). group:
        the query heads a K/V head serves (a task's shared memory grows with it)."""
        if device.type == "cuda":
            slots = _sm_count(device) * self.schedule.decode_tasks_per_sm(self.head_dim, self.dtype, self.knobs,
                                                                           group)
        else:
            slots = torch.get_num_threads() * self.schedule.decode_tasks_per_core(self.knobs)
        tiles = -(-max_keys // self.knobs["block_n"])
        return choose_num_splits(batch * heads_kv * self.query_blocks(seqlen_q, group), tiles, slots)

    def __call__(self, q, k_cache, v_cache, lengths, index, *, num_splits: int = 0, softmax_scale=None,
                 causal: bool = False, out=None, alibi_slopes=None):
        """(out, lse) of q over the cache; see the class docstring. num_splits=0 picks the count."""
        self.check_inputs(q, k_cache, v_cache, lengths, index, out)
        variant_arguments = self.variant_arguments(q, alibi_slopes)
        if not q.is_contiguous():
            q = q.contiguous()
        batch, seqlen_q, heads_q, _ = q.shape
        heads_kv = k_cache.shape[2]
        softmax_scale = resolve_softmax_scale(softmax_scale, self.head_dim)
        check_num_splits(num_splits)
        if num_splits == 0:
            capacity = index.shape[1] * self.page_size if self.page_size else k_cache.shape[1]
            num_splits = self.auto_num_splits(batch, heads_kv, seqlen_q, capacity, q.device, heads_q // heads_kv)
        if out is None:
            out = torch.empty_like(q)
        lse = torch.empty((batch, heads_q, seqlen_q), dtype=torch.float32, device=q.device)
        o_shape = (num_splits, batch, seqlen_q, heads_q, self.head_dim)  # the splits' partial outputs
        # a cache (or partial output) of more than 2**31 elements takes the module that indexes in int64
        wide = needs_int64(q, k_cache, v_cache, index) or math.prod(o_shape) > _INT32_MAX
        module = self.module(heads_q, heads_kv, wide)
        if module.function is None:
            raise RuntimeError(f"this {targets.describe(self.target)} kernel was cross-compiled: there is no GPU "
                               "here to run it on")
        if out.numel() and not (k_cache.numel() and index.numel() if self.page_size else k_cache.numel()):
            out.zero_()  # an empty cache: no key for anyone (and no tensor for the kernel to clamp into)
            lse.fill_(-math.inf)
        elif out.numel() and num_splits == 1:  # the split kernel writes the output: no merge
            module.function["single"](q, k_cache, v_cache, lengths, index, out, lse, softmax_scale,
                                      int(bool(causal)), *variant_arguments)
        elif out.numel():
            o_part = torch.empty(o_shape, dtype=torch.float32, device=q.device)
            lse_part = torch.empty((num_splits, batch, seqlen_q, heads_q), dtype=torch.float32, device=q.device)
            module.function["split"](q, k_cache, v_cache, lengths, index, o_part, lse_part, softmax_scale,
                                     int(bool(causal)), *variant_arguments)
            module.function["merge"](o_part, lse_part, out, lse)
        return out, lse

    def check_inputs(self, q, k_cache, v_cache, lengths, index, out) -> None:
        for name, t in (("cache_seqlens", lengths), ("block_table" if self.page_size else "cache_batch_idx", index)):
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
        self._check_tensors([("q", q), ("k_cache", k_cache), ("v_cache", v_cache)],
                            "(pages, page_size, heads, head_dim)" if self.page_size else "(batch, seqlen, heads, head_dim)")
        heads_kv = k_cache.shape[2]
        if heads_kv == 0 or q.shape[2] % heads_kv:
            raise ValueError(f"q: expected heads_q ({q.shape[2]}) to be a multiple of the cache's heads_kv ({heads_kv})")
        if self.page_size and k_cache.shape[1] != self.page_size:
            raise ValueError(f"k_cache: expected pages of {self.page_size} rows (num_pages, page_size, heads_kv, "
                             f"head_dim), got shape {tuple(k_cache.shape)}")
        batch = q.shape[0]
        index_shape = "(batch, pages_per_seq)" if self.page_size else "(batch,)"
        index_name = "block_table" if self.page_size else "cache_batch_idx"
        if lengths.dtype != torch.int32 or lengths.shape != (batch,):
            raise ValueError(f"cache_seqlens: expected int32 of shape ({batch},), got {lengths.dtype} of shape "
                             f"{tuple(lengths.shape)}")
        if index.dtype != torch.int32 or index.dim() != (2 if self.page_size else 1) or index.shape[0] != batch:
            raise ValueError(f"{index_name}: expected int32 of shape {index_shape} with batch {batch}, got "
                             f"{index.dtype} of shape {tuple(index.shape)}")
        cuda = targets.is_cuda(self.target)
        for name, t in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache), ("cache_seqlens", lengths),
                        (index_name, index)):
            if t.device != q.device:
                raise ValueError(f"{name}: expected device {q.device} (q's), got {t.device}")
            if needs_int64(t):  # more than 2**31 elements: an int64 module (``__call__``)
                check_strides(**{name: t})
        if q.device.type != ("cuda" if cuda else "cpu"):
            raise ValueError(f"q: the kernel was built for {targets.describe(self.target)}, got a tensor on {q.device}")
        for name, t in (("k_cache", k_cache), ("v_cache", v_cache), ("cache_seqlens", lengths), (index_name, index)):
            if not t.is_contiguous():  # the cache is written in place: never copied behind the caller's back
                raise ValueError(f"{name}: expected a contiguous tensor, got strides {t.stride()}")
        if q.numel() and q.stride(3) != 1:
            raise ValueError(f"q: expected a contiguous last dim (stride 1), got strides {q.stride()}")
        if cuda:
            for name, t in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache)):
                if t.data_ptr() % 16:
                    raise ValueError(f"{name}: expected a 16-byte aligned data pointer, got {t.data_ptr():#x}")
        if out is not None and (not isinstance(out, torch.Tensor) or out.shape != q.shape or out.dtype != q.dtype
                                or out.device != q.device or not out.is_contiguous()):
            raise ValueError(f"out: expected a contiguous tensor of q's shape {tuple(q.shape)}, dtype and device, got "
                             f"{getattr(out, 'shape', out)!r}")

    def batch_rows(self, batch: int, device: torch.device) -> torch.Tensor:
        """int32 [0, 1, ..., batch - 1] on ``device`` (the cache rows when no cache_batch_idx is given), kept."""
        rows = self._rows.get((batch, device))
        if rows is None:
            rows = self._rows[(batch, device)] = torch.arange(batch, dtype=torch.int32, device=device)
        return rows


def check_num_splits(num_splits) -> None:
    if not isinstance(num_splits, int) or isinstance(num_splits, bool) or not 0 <= num_splits <= MAX_SPLITS:
        raise ValueError(f"num_splits: expected an int from 0 (automatic) to {MAX_SPLITS}, got {num_splits!r}")


def choose_num_splits(tasks: int, tiles: int, slots: int, max_splits: int = MAX_AUTO_SPLITS) -> int:
    """Splits of each task's keys so that tasks * splits fill ``slots`` (the tasks the device runs at
    once) in waves that waste little: flash-attn's rule, the fewest splits whose wave efficiency
    (waves / ceil(waves)) is within 85% of the best, at most ``max_splits`` and at most ``tiles``
    (the K/V tiles of the longest sequence: a split with none would only write -inf)."""
    if tasks <= 0 or tiles <= 1 or tasks >= 0.8 * slots:
        return 1
    candidates = range(1, max(1, min(max_splits, tiles, slots)) + 1)

    def efficiency(splits):
        waves = tasks * splits / slots
        return waves / math.ceil(waves)

    best = max(efficiency(s) for s in candidates)
    return next(s for s in candidates if efficiency(s) >= 0.85 * best)


@functools.lru_cache(maxsize=None)
def _sm_count(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


_KERNELS: dict[str, DecodeKernel] = {}


def decode_workload(head_dim: int, dtype: str, page_size: int) -> dict:
    """What decode's tuning records are keyed by: head_dim, dtype and the cache layout (0:
    contiguous), with its pass (a variant takes the plain workload's knobs, as the forward's)."""
    return {"head_dim": head_dim, "dtype": dtype, "causal": False, "pass": "decode", "page_size": page_size}


def forget_kernels() -> None:
    """Drop the in-memory decode kernels, so the next one looks up tuned knobs afresh."""
    _KERNELS.clear()
    _BY_DEVICE.clear()


def compile_decode(*, head_dim: int, dtype, page_size: int = 0, target=None, knobs: dict | None = None,
                   heads_q: int | None = None, heads_kv: int | None = None, window_size=(-1, -1),
                   softcap: float = 0.0, alibi: bool = False, schedule: str | None = None) -> DecodeKernel:
    """Compile Flash-Decoding and return a :class:`DecodeKernel` (cached in memory; modules on disk).

    page_size: 0 for a contiguous cache, else the paged cache's rows per page (a power of two >= 16).
    target, knobs: as ``tvmflash.compile`` (knobs of the schedule's ``DECODE_KNOBS``). heads_q /
    heads_kv: build for these head counts now. window_size, softcap, alibi: as ``tvmflash.compile``'s,
    but a window's right edge 0 is no window: that is the call's ``causal``. schedule: "sm80" (tensor
    cores) or "simt"; None: TVMFLASH_DECODE, else sm80's where it applies (``schedules.decode_for_target``).
    """
    dtype = dtype_name(dtype)
    variant = resolve_variant(False, window_size, softcap, alibi)
    if variant.pop("causal"):
        raise ValueError(f"window_size: a right edge of 0 is causal, an argument of each call: pass causal=True and "
                         f"window_size=({window_size[0]}, -1)")
    DecodeSpec(head_dim, dtype, 1, 1, page_size, **variant)  # validates head_dim, dtype and page_size
    resolved = targets.resolve(target)
    module = schedule_registry.decode_for_target(resolved, dtype, head_dim, schedule)
    key = cache.digest([head_dim, dtype, page_size, str(resolved), knobs, variant, schedule_registry.name_of(module)])
    kernel = _KERNELS.get(key)
    if kernel is None:
        kernel = _KERNELS[key] = DecodeKernel(head_dim, dtype, page_size, resolved, knobs, variant, schedule)
    if heads_q is not None:
        kernel.module(heads_q, heads_kv if heads_kv is not None else heads_q)
    return kernel


_BY_DEVICE: dict[tuple, DecodeKernel] = {}  # (device, dtype, head_dim, page_size, variant, TVMFLASH_DECODE) -> kernel


def kernel_for(device: torch.device, dtype: torch.dtype, head_dim: int, page_size: int, window_size=(-1, -1),
               softcap: float = 0.0, alibi: bool = False) -> DecodeKernel:
    """The decode kernel for tensors on ``device`` and the variant (compiled on first use, then kept)."""
    key = (device, dtype, head_dim, page_size, window_size, softcap, alibi, os.environ.get("TVMFLASH_DECODE", ""))
    kernel = _BY_DEVICE.get(key)
    if kernel is None:
        if device.type == "cuda":
            target = targets.cuda_device_target(device.index)
        elif device.type == "cpu":
            target = "cpu"
        else:
            raise ValueError(f"q: expected a CPU or CUDA tensor, got one on {device}")
        kernel = _BY_DEVICE[key] = compile_decode(head_dim=head_dim, dtype=dtype, page_size=page_size, target=target,
                                                  window_size=window_size, softcap=softcap, alibi=alibi)
    return kernel


def _not_implemented(option: str, value) -> NotImplementedError:
    return NotImplementedError(f"flash_attn_with_kvcache: {option}={value!r} is not implemented yet in tvmflash")


def flash_attn_with_kvcache(q, k_cache, v_cache, k=None, v=None, rotary_cos=None, rotary_sin=None,
                            cache_seqlens=None, cache_batch_idx=None, cache_leftpad=None, block_table=None,
                            softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                            rotary_interleaved=True, alibi_slopes=None, num_splits=0, return_softmax_lse=False):
    """Attention of q over a KV cache, with flash-attn 2's arguments and semantics.

    q: (batch, seqlen_q, heads_q, head_dim): one token a sequence for decode, a few for chunked
    prefill or speculative decoding (causal within the chunk with ``causal=True``: query token t of
    seqlen_q sees the keys up to cache length - seqlen_q + t, bottom-right).
    k_cache, v_cache: (cache_batch, cache_len, heads_kv, head_dim), or with ``block_table``
    (num_pages, page_size, heads_kv, head_dim), page_size a power of two >= 16; heads_q a multiple
    of heads_kv (GQA/MQA). Contiguous, q's dtype (fp16, bf16 or fp32) and device.
    k, v (optional, both or neither): (batch, seqlen_new, heads_kv, head_dim), written into the cache
    in place at positions cache_seqlens[b] ... cache_seqlens[b] + seqlen_new - 1 before attending;
    the attention then sees cache_seqlens + seqlen_new keys. ``cache_seqlens`` itself is not
    updated (as in flash-attn).
    cache_seqlens: int, or int32 (batch,): the keys each sequence has in the cache; None: the whole
    cache (cache_len, or pages_per_seq * page_size). Read on the device: a new length never
    recompiles, and a CUDA graph replays with the values the tensor holds at replay.
    cache_batch_idx: int32 (batch,): the cache row of each sequence (contiguous cache only); None
    means row b for sequence b.
    block_table: int32 (batch, pages_per_seq): the pages of each sequence, in order.
    softmax_scale: defaults to 1 / sqrt(head_dim). num_splits: 0 picks the split count of the keys
    (Flash-Decoding) from the shapes and the device; 1 does not split; n uses n.
    window_size=(left, right): query token t sees the keys from n - seqlen_q + t - left to
    n - seqlen_q + t + right (n: the sequence's keys; -1: unbounded), and only the tiles a window
    reaches are read. softcap > 0: scores become softcap · tanh(score / softcap). alibi_slopes,
    float32 (heads_q,) or (batch, heads_q): -slope · |n - seqlen_q + t - p| is added to key p's
    score (after the cap). Each window and softcap value builds a module of its own.
    return_softmax_lse: also return the LSE, float32 (batch, heads_q, seqlen_q).
    rotary_cos, rotary_sin (both or neither, with k and v): (seqlen_ro, rotary_dim / 2), q's dtype
    and device, contiguous; rotary_dim a multiple of 16 up to head_dim, seqlen_ro at least the
    cache's capacity. Rotary embedding as flash-attn's: the new k is rotated at positions
    cache_seqlens[b], cache_seqlens[b] + 1, ... before it is appended; q is rotated at the same
    positions if causal or local (a window), else every token of q at position cache_seqlens[b].
    rotary_interleaved=True rotates the pairs of dims (0, 1), (2, 3), ... (GPT-J); False the pairs
    (i, i + rotary_dim / 2) (GPT-NeoX). The dims past rotary_dim are left as they are. The rotation
    is torch ops on q and k before the kernel (``apply_rotary``: float32 arithmetic, rounded to
    q's dtype, as flash-attn's kernel does; no host sync, so a CUDA graph captures it).

    Returns out (q's shape and dtype), or (out, lse). A query that sees no key gets 0 and an LSE of
    -inf. On the CPU, lengths and indices outside the cache are a ValueError; on a GPU they are not
    checked (that would wait for the device): the kernel clamps them to the cache, so it never reads
    outside it.

    Not implemented yet (NotImplementedError): cache_leftpad.
    """
    if cache_leftpad is not None:
        raise _not_implemented("cache_leftpad", "<tensor>")
    for name, flag in (("return_softmax_lse", return_softmax_lse), ("rotary_interleaved", rotary_interleaved)):
        if not isinstance(flag, bool):
            raise TypeError(f"{name}: expected True or False, got {flag!r}")
    variant = resolve_variant(causal, window_size, softcap, alibi_slopes is not None)  # checks causal too
    causal = variant.pop("causal")  # an argument of the call; the rest the kernel's
    for name, t in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 4:
            raise ValueError(f"{name}: expected 4 dims, got shape {tuple(t.shape)}")
    batch, device = q.shape[0], q.device
    paged = block_table is not None
    if paged and cache_batch_idx is not None:
        raise ValueError("cache_batch_idx: a paged cache (block_table) takes no cache_batch_idx; its block table "
                         "names each sequence's pages")
    if paged and (not isinstance(block_table, torch.Tensor) or block_table.dim() != 2):
        raise ValueError(f"block_table: expected an int32 tensor (batch, pages_per_seq), got "
                         f"{getattr(block_table, 'shape', block_table)!r}")
    capacity = block_table.shape[1] * k_cache.shape[1] if paged else k_cache.shape[1]

    if cache_seqlens is None:
        cache_seqlens = capacity
    if isinstance(cache_seqlens, int) and not isinstance(cache_seqlens, bool):
        cache_seqlens = torch.full((batch,), cache_seqlens, dtype=torch.int32, device=device)
    if not isinstance(cache_seqlens, torch.Tensor):
        raise TypeError(f"cache_seqlens: expected an int or an int32 tensor, got {type(cache_seqlens).__name__}")
    kernel = kernel_for(device, q.dtype, q.shape[-1], k_cache.shape[1] if paged else 0,
                        (variant.get("window_left", -1), variant.get("window_right", -1)), variant.get("softcap", 0.0),
                        variant.get("alibi", False))
    index = block_table if paged else cache_batch_idx if cache_batch_idx is not None else kernel.batch_rows(batch, device)
    # Check every argument before anything is written to the cache.
    kernel.check_inputs(q, k_cache, v_cache, cache_seqlens, index, None)
    kernel.variant_arguments(q, alibi_slopes)
    resolve_softmax_scale(softmax_scale, q.shape[-1])
    check_num_splits(num_splits)

    new = 0
    if (k is None) != (v is None):
        raise ValueError(f"{'v' if k is not None else 'k'}: expected k and v both or neither, got only "
                         f"{'k' if k is not None else 'v'}")
    if k is not None:
        want = (batch, k.shape[1] if isinstance(k, torch.Tensor) and k.dim() == 4 else -1, *k_cache.shape[2:])
        for name, t in (("k", k), ("v", v)):
            if not isinstance(t, torch.Tensor) or t.dim() != 4 or tuple(t.shape) != want:
                raise ValueError(f"{name}: expected shape (batch, seqlen_new, heads_kv, head_dim) = {want}, got "
                                 f"{getattr(t, 'shape', t)!r}")
            if t.dtype != k_cache.dtype or t.device != device:
                raise ValueError(f"{name}: expected the cache's dtype {k_cache.dtype} and device {device}, got "
                                 f"{t.dtype} on {t.device}")
        new = k.shape[1]
    rotary = rotary_cos is not None or rotary_sin is not None
    if rotary:
        _check_rotary(rotary_cos, rotary_sin, q, k, capacity)
    if device.type == "cpu":  # checking on a GPU would wait for it: there the kernel clamps instead
        _check_cache_values(cache_seqlens, new, capacity, index, paged, k_cache.shape[0])
    if rotary:
        # flash-attn's rule: q's tokens at successive positions if causal or local, else all at
        # cache_seqlens (a window bound as long as the cache is none, as flash-attn clears it)
        local = any(0 <= variant.get(side, -1) < capacity for side in ("window_left", "window_right"))
        k = apply_rotary(k, rotary_cos, rotary_sin, cache_seqlens, rotary_interleaved)
        q = apply_rotary(q, rotary_cos, rotary_sin, cache_seqlens, rotary_interleaved, successive=causal or local)
    if new:
        _append(k_cache, v_cache, k, v, cache_seqlens, index, paged)
        lengths = cache_seqlens + new
    else:
        lengths = cache_seqlens
    out, lse = kernel(q, k_cache, v_cache, lengths, index, num_splits=num_splits, softmax_scale=softmax_scale,
                      causal=causal, alibi_slopes=alibi_slopes)
    return (out, lse) if return_softmax_lse else out


def _check_rotary(rotary_cos, rotary_sin, q, k, capacity) -> None:
    """flash-attn's checks of rotary_cos and rotary_sin (before anything is written to the cache)."""
    if rotary_cos is None or rotary_sin is None:
        raise ValueError(f"{'rotary_sin' if rotary_sin is None else 'rotary_cos'}: expected rotary_cos and rotary_sin "
                         "both or neither")
    if k is None:
        raise ValueError("rotary_cos: rotary embedding needs the new k and v to append to the cache (flash-attn's rule)")
    head_dim = q.shape[-1]
    for name, t in (("rotary_cos", rotary_cos), ("rotary_sin", rotary_sin)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 2 or t.shape != rotary_cos.shape:
            raise ValueError(f"{name}: expected shape (seqlen_ro, rotary_dim / 2), rotary_cos's and rotary_sin's alike, "
                             f"got {tuple(t.shape)}")
        if t.dtype != q.dtype or t.device != q.device:
            raise ValueError(f"{name}: expected q's dtype {q.dtype} and device {q.device}, got {t.dtype} on {t.device}")
    seqlen_ro, rotary_dim = rotary_cos.shape[0], 2 * rotary_cos.shape[1]
    if not 0 < rotary_dim <= head_dim or rotary_dim % 16:
        raise ValueError(f"rotary_cos: expected rotary_dim (2 x its last dim) a multiple of 16 up to head_dim {head_dim}, "
                         f"got {rotary_dim}")
    if seqlen_ro < capacity:
        raise ValueError(f"rotary_cos: expected at least the cache's {capacity} positions (seqlen_ro), got {seqlen_ro}")


def apply_rotary(x, cos, sin, offsets, interleaved: bool, successive: bool = True):
    """x (batch, seqlen, heads, head_dim) rotated as flash-attn's ``apply_rotary_emb``: token i of
    sequence b at position offsets[b] + i (``successive``), or every token at offsets[b]. cos, sin:
    (seqlen_ro, rotary_dim / 2); the first rotary_dim dims rotate, in pairs (0, 1), (2, 3), ... if
    ``interleaved``, else (i, i + rotary_dim / 2); the rest are copied. Computed in float32 and
    rounded to x's dtype; a new tensor. Torch ops only, with the positions gathered on the device
    (no host sync; positions past the table are clamped to its last, as the cache's lengths are
    clamped by the kernel)."""
    half = cos.shape[1]
    positions = offsets.long()[:, None]
    if successive:
        positions = positions + torch.arange(x.shape[1], device=x.device)
    positions = positions.clamp(0, cos.shape[0] - 1).expand(x.shape[0], x.shape[1])
    c = cos[positions].float()[:, :, None, :]  # (batch, seqlen, 1, rotary_dim / 2)
    s = sin[positions].float()[:, :, None, :]
    rotated = x[..., : 2 * half].float()
    if interleaved:
        x1, x2 = rotated[..., 0::2], rotated[..., 1::2]
        rotated = torch.stack((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1).flatten(-2)
    else:
        x1, x2 = rotated[..., :half], rotated[..., half:]
        rotated = torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1)
    return torch.cat((rotated.to(x.dtype), x[..., 2 * half:]), dim=-1)


def _check_cache_values(cache_seqlens, new, capacity, index, paged, cache_rows) -> None:
    """Lengths and indices within the cache (CPU tensors: this reads their values)."""
    if cache_seqlens.numel() and (cache_seqlens.min() < 0 or cache_seqlens.max() + new > capacity):
        raise ValueError(f"cache_seqlens: expected lengths from 0 to the cache's {capacity} keys"
                         + (f" less the {new} new ones" if new else "") + f", got {cache_seqlens.tolist()}")
    if index.numel() and (index.min() < 0 or index.max() >= cache_rows):
        name, what = ("block_table", "page") if paged else ("cache_batch_idx", "cache row")
        raise ValueError(f"{name}: expected {what} indices from 0 to {cache_rows - 1}, got values from "
                         f"{index.min().item()} to {index.max().item()}")


def _append(k_cache, v_cache, k, v, cache_seqlens, index, paged) -> None:
    """Write k, v (batch, seqlen_new, heads_kv, head_dim) into the caches at cache_seqlens[b] + i, in
    place (torch indexing: no host sync, so a CUDA graph captures it)."""
    positions = cache_seqlens.long()[:, None] + torch.arange(k.shape[1], device=k.device)  # (batch, seqlen_new)
    if paged:
        page_size = k_cache.shape[1]
        rows = (index.long().gather(1, positions // page_size), positions % page_size)
    else:
        rows = (index.long()[:, None], positions)
    k_cache[rows] = k
    v_cache[rows] = v
