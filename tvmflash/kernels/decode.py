"""The decode kernel (Flash-Decoding over a KV cache).

``DecodeKernel`` builds the two programs of ``tvmflash.program_decode`` (the split kernel and the
merge) into one module per (head counts, cache layout), cached in memory and on disk by its
``Build`` as the forward's are, and calls them on torch tensors through DLPack. flash-attn's
``flash_attn_with_kvcache`` (``tvmflash.flash_attn``) is built on it.
"""

from __future__ import annotations

import functools
import math

import torch
import tvm

from tvmflash import choice, lowering, program_decode
from tvmflash import target as targets
from tvmflash.kernels.build import PROGRAMS, Build, describe
from tvmflash.kernels.checks import (INT32_MAX, Arguments, check_descale, check_num_splits, needs_int64,
                                     resolve_softmax_scale)
from tvmflash.program import FP8
from tvmflash.program_decode import DecodeSpec

FP8_TORCH = torch.float8_e4m3fn

# num_splits=0 never picks more splits than this (each split adds a partial output to write and merge;
# flash-attn's cap): a lone sequence needs about 100 splits to give each SM's six one-warp tasks work.
MAX_AUTO_SPLITS = 128


class DecodeKernel:
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
    than 2**31 elements one more, that indexes in int64 (``checks.needs_int64``).
    The variant (a window, a softcap, ALiBi, leftpad: ``compile_decode``) is the kernel's; with ALiBi
    each call takes ``alibi_slopes``, float32 (heads_q,) or (batch, heads_q), and with leftpad
    ``cache_leftpad``, int32 (batch,): sequence b's keys are then the cache rows cache_leftpad[b] ..
    lengths[b] - 1 (flash-attn's; a contiguous cache only). With sinks each call takes ``sinks``, float32
    (heads_q,), which the merge adds once (``program_decode.decode_merge``; one split runs the merge too).

    An FP8 cache (variant ``cache_dtype`` "float8_e4m3fn", ``program_decode``'s module docstring): the
    caches are torch.float8_e4m3fn, q and out ``dtype`` (fp16, bf16), and each call takes ``k_descale``
    and ``v_descale``, float32 (batch, heads_kv) (None: ones), FA3's: key p is k_cache[p] · k_descale[b,
    hk], value p v_cache[p] · v_descale[b, hk]. On the schedules whose ``DecodeTasks.fp8_cache`` is set
    (sm80's tensor cores, on sm80 and newer GPUs; the CPU's, which converts e4m3 by its bits); on a GPU
    only where TVMFLASH_GPU_UNCHECKED=1 asks until its GPU tests pass (``DecodeTasks.fp8_unchecked_head_dims``).
    """

    PASS = "decode"

    def __init__(self, head_dim: int, dtype: str, page_size: int, target: tvm.target.Target, knobs: dict | None,
                 variant: dict | None = None, schedule: str | None = None):
        self.head_dim, self.dtype, self.causal, self.page_size = head_dim, dtype, False, page_size
        self.variant, self.target = dict(variant or {}), target
        # sm80's tensor cores on sm80+ GPUs (fp16/bf16), else SIMT threads, or the CPU's schedule
        chosen = choice.decode(target, {"head_dim": head_dim, "dtype": dtype, "causal": False}, page_size, knobs,
                               schedule, self.variant.get("cache_dtype"))
        self.schedule, self.schedule_source = chosen.schedule, chosen.schedule_source
        self.knobs, self.knobs_source = chosen.knobs, chosen.knobs_source
        self.tasks = self.schedule.decode.tasks
        self.fp8_cache = self.variant.get("cache_dtype", "") == FP8
        if self.fp8_cache:
            if not self.tasks.fp8_cache:
                raise NotImplementedError(f"an FP8 (e4m3) KV cache: the {self.schedule.name} decode schedule does not "
                                          f"read one (the sm80 schedule on sm80+ GPUs and the CPU's do, at the head_dims "
                                          f"they serve)")
            problem = choice.unchecked_problem(f"the {self.schedule.name} decode over an FP8 cache", head_dim,
                                               self.tasks.fp8_unchecked_head_dims)
            if problem:
                raise NotImplementedError(problem)
        # the program variant the schedule maps: operands in q's dtype for tensor cores, else float32
        self.tensor_cores = self.tasks.tensor_cores
        self.arguments = Arguments(head_dim, dtype, target, self.variant)
        # an FP8 cache where the target has no FP8 conversion of its own (the CPU, sm_80, sm_86): converted by its
        # bits, since TVM's legalized conversion there is wrong at zero and the subnormals; in the key, as a
        # choice made outside the programs' and schedules' sources
        self.e4m3_bits = self.fp8_cache and not targets.converts_fp8(target)
        fp8_key = {"e4m3 conversion": "bits" if self.e4m3_bits else "cast"} if self.fp8_cache else {}
        self.build = Build(kind=self.PASS, target=target, schedule=self.schedule, knobs=self.knobs,
                           variant=self.variant, spec=self.spec, programs=self._scheduled,
                           entry=lambda module: {name: module[name] for name in ("split", "single", "merge")},
                           code=(*PROGRAMS, *self.schedule.sources, *lowering.MODULES),
                           options=self.schedule.build_options("decode"),
                           outer={"pass": self.PASS, "tensor cores": self.tensor_cores, **fp8_key})
        # as the forward's: a module for some head counts, its CUDA source, its scheduled TensorIR
        self.module, self.source, self.scheduled_tir = self.build.module, self.build.source, self.build.scheduled_tir
        self._rows: dict[tuple[int, torch.device], torch.Tensor] = {}  # arange(batch) per device: cache rows

    # ----------------------------------------------------------------- building
    def spec(self, heads_q: int, heads_kv: int) -> DecodeSpec:
        return DecodeSpec(self.head_dim, self.dtype, heads_q, heads_kv, self.page_size, **self.variant)

    def _scheduled(self, spec: DecodeSpec) -> tvm.s_tir.Schedule:
        """The programs in one module, scheduled: ``split`` and ``merge``, and ``single`` (the split
        program as one split writing the output itself: no merge, no partial buffers)."""
        split, single = (program_decode.decode_split(spec, self.query_tokens(spec.group), self.knobs["block_n"],
                                                     final=final, tensor_cores=self.tensor_cores,
                                                     e4m3_bits=self.e4m3_bits,
                                                     byte_tiles=self.tasks.fp8_byte_tiles(self.head_dim, self.knobs,
                                                                                          not self.e4m3_bits))
                         for final in (False, True))
        merge = program_decode.decode_merge(spec)
        mod = tvm.IRModule({"split": split.with_attr("global_symbol", "split"),
                            "single": single.with_attr("global_symbol", "single"),
                            "merge": merge.with_attr("global_symbol", "merge")})
        return self.schedule.decode.apply(tvm.s_tir.Schedule(mod), **self.knobs)

    def info(self) -> dict:
        """What this kernel is, and where each of its modules came from."""
        return describe(self, after={"pass": self.PASS, "causal": "per call", "page_size": self.page_size})

    def __repr__(self) -> str:
        layout = f"paged {self.page_size}" if self.page_size else "contiguous"
        variant = "".join(f"{name}={value!r}, " for name, value in self.variant.items())
        return (f"tvmflash.DecodeKernel(head_dim={self.head_dim}, dtype={self.dtype}, {layout}, {variant}"
                f"target={targets.describe(self.target)!r})")

    # ----------------------------------------------------------------- using
    def query_tokens(self, group: int) -> int:
        """Query tokens of a task, for a GQA group of ``group`` query heads (the tensor-core schedule fills
        whole mma tiles of rows; the others take the knob)."""
        return self.tasks.query_tokens(group, self.knobs)

    def query_blocks(self, seqlen_q: int, group: int) -> int:
        return -(-seqlen_q // self.query_tokens(group))

    def auto_num_splits(self, batch: int, heads_kv: int, seqlen_q: int, max_keys: int, device: torch.device,
                        group: int = 8) -> int:
        """The split count for ``num_splits=0``, from static shapes only (so that a CUDA graph's
        buffers fit every replay): enough tasks to fill the device (``choose_num_splits``). group:
        the query heads a K/V head serves (a task's shared memory grows with it)."""
        processors = _sm_count(device) if device.type == "cuda" else torch.get_num_threads()
        knobs = self.knobs
        if self.fp8_cache:  # (its tiles' shared memory is the schedule's to model)
            knobs = {**knobs, "fp8_cache": True}
        slots = processors * self.tasks.per_processor(self.head_dim, self.dtype, knobs, group)
        tiles = -(-max_keys // self.knobs["block_n"])
        return choose_num_splits(batch * heads_kv * self.query_blocks(seqlen_q, group), tiles, slots)

    def check_inputs(self, q, k_cache, v_cache, lengths, index, out) -> None:
        """The call's tensors (``checks.Arguments.check_decode``; an FP8 cache: e4m3 caches)."""
        self.arguments.check_decode(self.page_size, q, k_cache, v_cache, lengths, index, out,
                                    cache_dtype=FP8_TORCH if self.fp8_cache else None)

    def descale_arguments(self, q, k_cache, k_descale, v_descale) -> tuple:
        """With an FP8 cache, (k_descale, v_descale): float32 (batch, heads_kv) on q's device (None:
        ones), compact; () without (where a descale is a TypeError)."""
        if not self.fp8_cache:
            if k_descale is not None or v_descale is not None:
                raise TypeError("k_descale, v_descale: only with an FP8 (torch.float8_e4m3fn) cache")
            return ()
        batch, heads_kv = q.shape[0], k_cache.shape[2]
        return tuple(check_descale(name, d, batch, heads_kv, q.device)
                     for name, d in (("k_descale", k_descale), ("v_descale", v_descale)))

    def variant_arguments(self, q, alibi_slopes, cache_leftpad=None) -> tuple:
        """The split programs' arguments after causal: the ALiBi slopes' view if the kernel has ALiBi, then
        cache_leftpad if it has leftpad (``checks.Arguments``)."""
        return self.arguments.alibi_arguments(q, alibi_slopes, None) + self.arguments.leftpad_arguments(q, cache_leftpad)

    def merge_arguments(self, q, sinks) -> tuple:
        """The merge's arguments after lse: (sinks,) if the kernel has sinks (``checks.Arguments.sinks_arguments``)."""
        return self.arguments.sinks_arguments(q, sinks, q.shape[2])

    def batch_rows(self, batch: int, device: torch.device) -> torch.Tensor:
        """int32 [0, 1, ..., batch - 1] on ``device`` (the cache rows when no cache_batch_idx is given), kept."""
        rows = self._rows.get((batch, device))
        if rows is None:
            rows = self._rows[(batch, device)] = torch.arange(batch, dtype=torch.int32, device=device)
        return rows

    def __call__(self, q, k_cache, v_cache, lengths, index, *, num_splits: int = 0, softmax_scale=None,
                 causal: bool = False, out=None, alibi_slopes=None, cache_leftpad=None, sinks=None, k_descale=None,
                 v_descale=None):
        """(out, lse) of q over the cache; see the class docstring. num_splits=0 picks the count."""
        self.check_inputs(q, k_cache, v_cache, lengths, index, out)
        variant_arguments = (self.variant_arguments(q, alibi_slopes, cache_leftpad)
                             + self.descale_arguments(q, k_cache, k_descale, v_descale))
        merge_arguments = self.merge_arguments(q, sinks)
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
        wide = needs_int64(q, k_cache, v_cache, index) or math.prod(o_shape) > INT32_MAX
        module = self.build.runnable(self.build.module(heads_q, heads_kv, wide))
        if out.numel() and not (k_cache.numel() and index.numel() if self.page_size else k_cache.numel()):
            out.zero_()  # an empty cache: no key for anyone (and no tensor for the kernel to clamp into)
            if merge_arguments:  # a sink: lse is its logit
                lse.copy_(merge_arguments[0][None, :, None].expand_as(lse))
            else:
                lse.fill_(-math.inf)
        elif out.numel() and num_splits == 1 and not merge_arguments:  # the split kernel writes the output: no merge
            module.function["single"](q, k_cache, v_cache, lengths, index, out, lse, softmax_scale,
                                      int(bool(causal)), *variant_arguments)
        elif out.numel():
            o_part = torch.empty(o_shape, dtype=torch.float32, device=q.device)
            lse_part = torch.empty((num_splits, batch, seqlen_q, heads_q), dtype=torch.float32, device=q.device)
            module.function["split"](q, k_cache, v_cache, lengths, index, o_part, lse_part, softmax_scale,
                                     int(bool(causal)), *variant_arguments)
            module.function["merge"](o_part, lse_part, out, lse, *merge_arguments)  # (the sink joins here, once)
        return out, lse


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
