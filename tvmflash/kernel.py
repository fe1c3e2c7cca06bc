"""Compiling the attention program for a target, caching the result, and calling it on torch tensors."""

from __future__ import annotations

import copy
import gc
import logging
import math
import os
import threading
import time
import warnings
from dataclasses import asdict, dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

import torch

# TVM's CPU thread pool starts with one thread per two cores; use every core torch uses, unless
# the user chose (TVM reads this when its pool starts, at the first CPU kernel call).
os.environ.setdefault("TVM_NUM_THREADS", str(torch.get_num_threads()))

import tvm  # noqa: E402

from tvmflash import cache, database, lowering, program, program_backward  # noqa: E402
from tvmflash import schedules as schedule_registry  # noqa: E402
from tvmflash import target as targets  # noqa: E402
from tvmflash.program import AttentionSpec  # noqa: E402

# Builds and loads are logged at INFO (the CLI shows them): a GPU build takes tens of seconds on a CPU.
logger = logging.getLogger("tvmflash")
TORCH_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}
_INT32_MAX = 2**31 - 1


def needs_int64(*tensors) -> bool:
    """Does any of the tensors (None: skipped) hold an element more than 2**31 - 1 elements past its
    first? Their modules then index in int64 (``lowering.passes.WidenGlobalIndices``); smaller
    problems keep int32 modules, and their speed."""
    for t in tensors:
        if t is None or not t.numel():
            continue
        # a contiguous tensor's last element is numel - 1 past its first (the common case, and a C
        # call: this runs at every call of every kernel, a training step's included)
        last = t.numel() - 1 if t.is_contiguous() else sum((n - 1) * s for n, s in zip(t.shape, t.stride()))
        if last > _INT32_MAX:
            return True
    return False


def one_batch(t: torch.Tensor) -> torch.Tensor:
    """Packed rows (rows, ...) as the programs' batch of one, (1, rows, ...), with no copy. Its batch
    stride is the row stride, not torch's rows x row stride: the modules take each stride as an int32,
    and past 2**31 elements that product would wrap (negative, which a TMA tensor map rejects). The one
    batch's index is 0, so the stride is never used."""
    return t.as_strided((1, *t.shape), (t.stride(0), *t.stride()), t.storage_offset())


def check_strides(**tensors) -> None:
    """Every stride of each named tensor (None: skipped; of a dimension longer than 1) below 2**31:
    the modules take each stride and dimension as an int32 (only their sum of products, the offset,
    is computed in int64). Only tensors past 2**31 elements (``needs_int64``) can fail it."""
    for name, t in tensors.items():
        if t is not None and any(n > 1 and s > _INT32_MAX for n, s in zip(t.shape, t.stride())):
            raise ValueError(f"{name}: strides of 2**31 elements or more are not supported (tensors of more than "
                             f"2**31 elements are, where one index of the first dim holds fewer), got shape "
                             f"{tuple(t.shape)}, strides {t.stride()}")


@dataclass
class _Module:
    """One built (or loaded) module: a spec with fixed head counts, for one target."""

    function: Any  # the callable ``main(q, k, v, out, lse, softmax_scale)``; None if it can't run here
    source: str | None  # the generated CUDA source; None for the CPU or a module loaded from disk
    origin: str  # "built" or "disk cache"
    path: str | None  # where it is on disk, if anywhere
    seconds: float  # time to build or load


_MODULES: dict[str, _Module] = {}  # in-memory cache: key -> module
_LOCK = threading.Lock()


def default_knobs(schedule, head_dim: int, varlen: bool = False) -> dict:
    """A schedule's default knobs for a head_dim: ``KNOBS``, updated by ``KNOBS_FOR_HEAD_DIM`` (and
    with varlen by ``VARLEN_KNOBS``, the knobs that varlen's packed sequences require)."""
    return {**schedule.KNOBS, **getattr(schedule, "KNOBS_FOR_HEAD_DIM", {}).get(head_dim, {}),
            **(getattr(schedule, "VARLEN_KNOBS", {}) if varlen else {})}


def backward_default_knobs(schedule, head_dim: int) -> dict:
    """A schedule's default backward knobs for a head_dim: ``BACKWARD_KNOBS``, updated by
    ``BACKWARD_KNOBS_FOR_HEAD_DIM``."""
    return {**schedule.BACKWARD_KNOBS, **getattr(schedule, "BACKWARD_KNOBS_FOR_HEAD_DIM", {}).get(head_dim, {})}


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


def check_flag(name: str, value) -> bool:
    """A boolean option: True or False; anything else (``causal="no"``, 1, None) is a TypeError."""
    if not isinstance(value, bool):
        raise TypeError(f"{name}: expected True or False, got {value!r}")
    return value


# The variant fields of a spec (``program.AttentionSpec``): in a kernel's spec_args only where they are on,
# so that a kernel without them is named, cached and tuned as before they existed.
VARIANT_FIELDS = ("window_left", "window_right", "softcap", "alibi", "varlen")
WORKLOAD_FIELDS = ("head_dim", "dtype", "causal")  # what tuning records are keyed by


def resolve_variant(causal, window_size=(-1, -1), softcap=0.0, alibi=False) -> dict:
    """flash-attn's options, checked, as spec_args fields: ``causal`` and the variant fields that are
    on. As flash-attn: a window's right edge 0 is causal, and causal takes no other right edge; a
    bound of ``program.MAX_WINDOW`` or more is none (no sequence is that long)."""
    check_flag("causal", causal)
    check_flag("alibi", alibi)
    if not (isinstance(window_size, (tuple, list)) and len(window_size) == 2
            and all(isinstance(w, int) and not isinstance(w, bool) for w in window_size)):
        raise TypeError(f"window_size: expected a pair of ints (left, right), got {window_size!r}")
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
    on = {"window_left": left, "window_right": right, "softcap": float(softcap), "alibi": alibi}
    return {"causal": causal, **{name: value for name, value in on.items() if value not in (-1, 0.0, False)}}


def varlen_field(varlen) -> dict:
    """The spec_args field of varlen: {"varlen": True}, or none when off (dense kernels keep their keys)."""
    return {"varlen": True} if check_flag("varlen", varlen) else {}


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


def build_options(schedule) -> dict:
    """What a schedule module asks of ``lowering.build`` (plain values: the tuner's builder workers
    receive them pickled): its PassContext config, whether its tensor-core operands are read
    through the async proxy (wgmma), and whether conditions on the block indices are hoisted."""
    return {"pass_config": getattr(schedule, "PASS_CONFIG", {}),
            "async_proxy_operands": getattr(schedule, "ASYNC_PROXY_OPERANDS", False),
            "hoist_block_index_conditions": getattr(schedule, "HOIST_BLOCK_INDEX_CONDITIONS", False)}


def _runnable_here(target: tvm.target.Target) -> bool:
    return not targets.is_cuda(target) or torch.cuda.is_available()


class Kernel:
    """FlashAttention forward for one (head_dim, dtype, causal, variant, target).

    Call it on torch tensors in flash-attn's layout::

        out = kernel(q, k, v)                   # q: (batch, seqlen_q, heads_q, head_dim)
        out, lse = kernel(q, k, v, return_lse=True)  # k, v: (batch, seqlen_k, heads_kv, head_dim)

    out has q's shape and dtype; lse is float32 of shape (batch, heads_q, seqlen_q). The tensors
    are read (and out written) in place through their strides, which may be any with a contiguous
    last dim: (b, s, h, d) tensors and (b, h, s, d) ones seen through ``transpose(1, 2)`` alike. On
    CUDA a tensor whose batch, sequence or head stride is no multiple of 16 bytes, or 0 (a
    broadcast), is copied first (out: written to a compact tensor, then copied); no transpose or
    slice of a compact tensor at a supported head_dim needs that. A new out is compact. batch and
    the sequence lengths may change from call to call without rebuilding; each new pair of head
    counts builds (or loads) one more module.

    The variant (``compile``'s window_size, softcap, alibi) is the kernel's; with ALiBi each call
    takes ``alibi_slopes``, float32 (heads_q,) or (batch, heads_q).
    """

    PASS = "forward"  # what the modules compute (the disk cache's metadata says it)
    # seqlen bucket -> a copy with that bucket's tuned knobs (``_bucket_kernels``); none for the
    # kernels of other passes (backward, decode), which keep this empty one
    _by_bucket: dict = {}

    def __init__(self, spec_args: dict, target: tvm.target.Target, knobs: dict | None):
        self._set_problem(spec_args, target)
        self.key = kernel_key(spec_args, target, knobs)
        self.schedule, self.schedule_source, records = choose_schedule(target, spec_args, knobs)
        schedule_name = schedule_registry.name_of(self.schedule)
        self._stride_multiple = program.stride_multiple(schedule_registry.stride_alignment(self.schedule), self.dtype)
        self._check_knob_names(knobs, self.schedule.KNOBS)
        for name, value in (knobs or {}).items():
            problem = schedule_registry.knob_problem(self.schedule, name, value)
            if problem:
                raise ValueError(problem)
        # Knobs: the caller's, else the tuned ones for this GPU (if `tvmflash tune` or the shipped
        # logs have them), else the schedule's defaults.
        if knobs:
            tuned = None
        else:  # choose_schedule may have read this schedule's best record already
            tuned = records[schedule_name] if schedule_name in records else database.lookup(
                target, schedule_name, workload(spec_args))
        varlen = self.variant.get("varlen", False)
        required = getattr(self.schedule, "VARLEN_KNOBS", {}) if varlen else {}  # over the tuned (dense) knobs
        wrong = {name: value for name, value in (knobs or {}).items() if name in required and value != required[name]}
        if wrong:
            raise ValueError(f"knobs: varlen on the {schedule_name} schedule takes {required}, got {wrong}")
        defaults = default_knobs(self.schedule, self.head_dim, varlen)
        self.knobs = {**defaults, **(tuned["knobs"] if tuned else {}), **required, **(knobs or {})}
        if knobs:
            self.knobs_source = "given"
        elif tuned:
            # tuning stores the defaults where none of its candidates beat them: they are no tuned knobs
            what = "defaults (tuning found none faster:" if self.knobs == defaults else "tuned ("
            self.knobs_source = f"{what} {tuned['source']}, {tuned['mean_ms']:.3f} ms at {tuned.get('shape')})"
        else:
            self.knobs_source = "defaults"
        self._fit_shared_memory(given=bool(knobs))
        self._modules: dict[tuple[int, int], _Module] = {}
        self._last: tuple[int, int] | None = None
        self._by_bucket = self._bucket_kernels(schedule_name, workload(spec_args), database.bucket(tuned)) \
            if tuned and not varlen else {}
        _BY_KEY[self.key] = self

    def _bucket_kernels(self, schedule_name: str, tuned_workload: dict, own: int) -> dict:
        """By seqlen_k bucket (``database.SEQLEN_BUCKETS``): a copy of this kernel with that bucket's
        tuned knobs, in modules of its own, for each bucket other than ``own`` (the bucket of the
        record these knobs came from) whose record has other knobs. ``__call__`` runs the copy for
        key lengths in its bucket."""
        children = {}
        for index, seqlen in enumerate(database.bucket_seqlens()):
            record = None if index == own else database.lookup(self.target, schedule_name, tuned_workload, seqlen)
            if record is None or database.bucket(record) != index:
                continue
            child = copy.copy(self)
            child.knobs = {**default_knobs(self.schedule, self.head_dim), **record["knobs"]}
            if child.knobs == self.knobs:
                continue
            child.knobs_source = (f"tuned for {database.bucket_label(index)} ({record['source']}, "
                                  f"{record['mean_ms']:.3f} ms at {record.get('shape')})")
            child._modules, child._last, child._by_bucket = {}, None, {}
            child._fit_shared_memory(given=False)
            children[index] = child
        return children

    def _set_problem(self, spec_args: dict, target: tvm.target.Target) -> None:
        """The workload and target, and plain values of them for the call path (torch.compile traces
        no TVM object)."""
        self.head_dim = spec_args["head_dim"]
        self.dtype = spec_args["dtype"]
        self.causal = spec_args["causal"]
        self.variant = {name: spec_args[name] for name in VARIANT_FIELDS if name in spec_args}
        self.alibi = self.variant.get("alibi", False)
        self.target = target
        self._cuda, self._target_name = targets.is_cuda(target), targets.describe(target)
        self._device_type, self._torch_dtype = "cuda" if self._cuda else "cpu", TORCH_DTYPES[self.dtype]

    def _check_knob_names(self, knobs: dict | None, known: dict, kind: str = "") -> None:
        """Every knob given is one of ``known``, the schedule's knobs of this ``kind`` (its KNOBS,
        BACKWARD_KNOBS or DECODE_KNOBS)."""
        unknown = set(knobs or {}) - set(known)
        if unknown:
            raise ValueError(f"knobs: {sorted(unknown)} are not {kind}knobs of the "
                             f"{schedule_registry.name_of(self.schedule)} schedule; it has {sorted(known)}")

    def _take_knobs(self, defaults: dict, tuned: dict | None, given: dict | None) -> None:
        """The knobs of another pass's kernel (backward, decode): the caller's over a tuned record's
        over the defaults, and ``knobs_source``, where they came from."""
        self.knobs = {**defaults, **(tuned["knobs"] if tuned else {}), **(given or {})}
        if given:
            self.knobs_source = "given"
        elif tuned:
            self.knobs_source = f"tuned ({tuned['source']}, {tuned['mean_ms']:.3f} ms at {tuned.get('shape')})"
        else:
            self.knobs_source = "defaults"

    def _fit_shared_memory(self, given: bool) -> None:
        """Knobs whose tiles need more shared memory than the target allows: an error for the
        caller's own, else the defaults (or tuned knobs) shrunk along the schedule's SPACE, fewer
        pipeline stages first, then smaller K/V tiles, then smaller Q blocks."""
        def over(knobs):
            return targets.shared_memory_over(self.target, self.schedule, self.head_dim, self.dtype, knobs)

        problem = over(self.knobs)
        if problem is None:
            return
        if given:
            raise ValueError(f"knobs: {self.knobs} need {problem}; try a smaller block_n or num_stages")
        space, knobs = self.schedule.SPACE, dict(self.knobs)
        for name in ("num_stages", "block_n", "block_m"):
            values = space.get(name)
            for value in sorted(v for v in (values if isinstance(values, list) else []) if v < knobs.get(name, 0))[::-1]:
                knobs[name] = value
                for dependent, rule in space.items():  # e.g. num_warps follows block_m
                    if callable(rule):
                        knobs[dependent] = rule(knobs)[0]
                if over(knobs) is None:
                    self.knobs = knobs
                    self.knobs_source = f"{self.knobs_source}, shrunk to fit shared memory (they needed {problem})"
                    return
        raise ValueError(f"no knobs of the {schedule_registry.name_of(self.schedule)} schedule fit the shared memory "
                         f"at head_dim {self.head_dim}: the {self.knobs_source} knobs need {problem}")

    # ----------------------------------------------------------------- building
    def _spec(self, heads_q: int, heads_kv: int) -> AttentionSpec:
        return AttentionSpec(self.head_dim, self.dtype, self.causal, heads_q, heads_kv, **self.variant)

    def _code(self) -> str:
        """A digest of every module whose code shapes the build: schedules/common.py holds code of the
        sm80 and sm90 schedules (the row-reduce intrinsic); the lowering's passes shape every build."""
        return cache.source_digest(program, self.schedule, schedule_registry.common, *lowering.MODULES)

    def _key(self, spec: AttentionSpec, wide: bool = False) -> str:
        return cache.digest(
            {
                "tvmflash": _version(),
                "tvm": tvm.__version__,
                "code": self._code(),
                "spec": asdict(spec),
                "knobs": self.knobs,
                "target": str(self.target),
                **({"build": self._build_options()} if self.variant.get("varlen") else {}),  # (dense keys unchanged)
                **({"index_bits": 64} if wide else {}),  # an int64 module's own key; int32 ones keep theirs
            }
        )

    def _module_for(self, heads_q: int, heads_kv: int, **tensors):
        """The module to run on these named tensors: built (or loaded) for the head counts, indexing in
        int64 where one holds more than 2**31 elements (``needs_int64``; their strides checked), and
        not cross-compiled."""
        wide = needs_int64(*tensors.values())
        if wide:
            check_strides(**tensors)
        module = self._modules.get(self._slot(heads_q, heads_kv, wide)) or self.module(heads_q, heads_kv, wide)
        if module.function is None:
            raise RuntimeError(f"this {self._target_name} kernel was cross-compiled: there is no GPU here to run it on")
        return module

    @staticmethod
    def _slot(heads_q: int, heads_kv: int, wide: bool = False) -> tuple:
        """A module's place in ``_modules``: (heads_q, heads_kv), and "int64" for a wide one."""
        return (heads_q, heads_kv, "int64") if wide else (heads_q, heads_kv)

    def module(self, heads_q: int, heads_kv: int, wide: bool = False) -> _Module:
        """The module for these head counts: from memory, else from disk, else built now. wide: the
        module that indexes its tensors in int64, for tensors of more than 2**31 elements
        (``needs_int64``); a module of its own, built on first use."""
        found = self._modules.get(self._slot(heads_q, heads_kv, wide))
        if found is not None:
            return found
        spec = self._spec(heads_q, heads_kv)
        key = self._key(spec, wide)
        with _LOCK:
            found = _MODULES.get(key)
            if found is None:
                found = self._load(key)
                if found is None:
                    variant = "".join(f" {name}={value}" for name, value in self.variant.items())
                    what = (f"d{spec.head_dim} {spec.dtype}{' causal' if spec.causal else ''}{variant} "
                            f"hq{spec.heads_q}/hkv{spec.heads_kv}{' int64' if wide else ''}")
                    logger.info("building %s for %s (%s schedule)...", what, self._target_name,
                                schedule_registry.name_of(self.schedule))
                    found = self._build(spec, key, wide)
                logger.info("%s %s in %.1f s%s", "built" if found.origin == "built" else "loaded", found.path or "it",
                            found.seconds, "" if found.function else " (CUDA source only: no GPU here to build for)")
                _MODULES[key] = found
        self._modules[self._slot(heads_q, heads_kv, wide)] = found
        self._last = (heads_q, heads_kv)
        return found

    def _path(self, key: str) -> Path:
        """Where a module is cached: its library, or the CUDA source of a cross-compile (a file of its own:
        a GPU machine that shares the cache dir builds the library)."""
        return cache.module_dir() / (f"{key}.so" if _runnable_here(self.target) else f"{key}-source.cu")

    def _load(self, key: str) -> _Module | None:
        path = self._path(key)
        if not path.exists():
            return None
        problem = cache.module_problem(path)
        if problem:  # checked first: a truncated library can crash the loader (a bus error)
            warnings.warn(f"tvmflash: rebuilding cached module {path}: {problem}", stacklevel=3)
            return None
        start = time.perf_counter()
        if path.suffix == ".cu":
            return _Module(None, path.read_text(), "disk cache", str(path), time.perf_counter() - start)
        try:
            function = self._entry(tvm.runtime.load_module(str(path)))
        except Exception as err:  # noqa: BLE001 - a broken cache file must not be fatal
            warnings.warn(f"tvmflash: ignoring unreadable cached module {path}: {err}", stacklevel=3)
            return None
        return _Module(function, None, "disk cache", str(path), time.perf_counter() - start)

    def _scheduled(self, spec: AttentionSpec) -> tvm.s_tir.Schedule:
        sch = tvm.s_tir.Schedule(schedule_registry.program_for(spec, self.schedule, self.knobs))
        return self.schedule.schedule(sch, **self.knobs)

    def _build(self, spec: AttentionSpec, key: str, wide: bool = False) -> _Module:
        start = time.perf_counter()
        sch = self._scheduled(spec)
        executable = lowering.build(sch.mod, self.target, **self._build_options(), wide_indices=wide)
        source = executable.mod.imports[0].inspect_source() if targets.is_cuda(self.target) else None
        # TVMScript's parser keeps the Python stack of each T.prim_func in a reference cycle (its
        # inspect.stack()), and with it the frames of the call that needed this module and their
        # tensors (the first training step's activations): free it now, not at the next full collection
        gc.collect()
        seconds = time.perf_counter() - start
        runnable = _runnable_here(self.target)
        path = self._path(key)
        try:
            meta = {"key": key, "pass": self.PASS, "spec": asdict(spec), "knobs": self.knobs, "target": str(self.target),
                    "schedule": schedule_registry.name_of(self.schedule), "tvm": tvm.__version__,
                    "tvmflash": _version(), "code": self._code(), "created": time.strftime("%Y-%m-%d %H:%M:%S"),
                    **({"index_bits": 64} if wide else {})}
            cache.write_module(path, executable.export_library if runnable else lambda tmp: Path(tmp).write_text(source),
                               meta)
        except Exception as err:  # noqa: BLE001 - caching is an optimisation, never a failure
            warnings.warn(f"tvmflash: could not write {path} to the disk cache: {err}", stacklevel=3)
            path = None
        return _Module(self._entry(executable) if runnable else None, source, "built", str(path) if path else None,
                       seconds)

    def _entry(self, module):
        """What a built or loaded module gives to call: its ``main``."""
        return module["main"]

    def _build_options(self) -> dict:
        """What ``lowering.build`` takes for this kernel's modules: its schedule's ``build_options``,
        and for varlen the tile tests hoisted on every schedule (``HoistBlockIndexConditions``): nvcc
        unswitched the sm80 schedule's dense K/V step on the causal tile test (two bodies in its PTX,
        d64: 1108 and 1261 instructions) but not varlen's (one of 1694), whose test reads the
        sequence's offsets too."""
        options = build_options(self.schedule)
        if self.variant.get("varlen"):
            options["hoist_block_index_conditions"] = True
        return options

    # ----------------------------------------------------------------- using
    def source(self, heads_q: int | None = None, heads_kv: int | None = None, wide: bool = False) -> str:
        """The generated CUDA source, built for these head counts (default: the last used, or 1/1);
        wide: of the module that indexes in int64 (``module``)."""
        if not targets.is_cuda(self.target):
            raise ValueError(f"source(): only CUDA targets have CUDA source; this kernel targets {self.target}")
        if heads_q is None:
            heads_q, heads_kv = self._last or (1, 1)
        module = self.module(heads_q, heads_kv if heads_kv is not None else heads_q, wide)
        if module.source is None:  # loaded from disk: build once more to see the source
            spec = self._spec(heads_q, heads_kv if heads_kv is not None else heads_q)
            module.source = self._build(spec, self._key(spec, wide), wide).source
        return module.source

    def scheduled_tir(self, heads_q: int = 1, heads_kv: int | None = None) -> str:
        """The scheduled TensorIR (TVMScript) for these head counts, before lowering."""
        return self._scheduled(self._spec(heads_q, heads_kv or heads_q)).mod.script()

    def info(self) -> dict:
        """What this kernel is, and where each of its modules came from."""
        return {
            "head_dim": self.head_dim,
            "dtype": self.dtype,
            "causal": self.causal,
            **self.variant,
            "target": targets.describe(self.target),
            "schedule": schedule_registry.name_of(self.schedule),
            "schedule_source": self.schedule_source,
            "knobs": dict(self.knobs),
            "knobs_source": self.knobs_source,
            **({"seqlen_buckets": {database.bucket_label(index): {"knobs": dict(child.knobs),
                                                                  "knobs_source": child.knobs_source}
                                   for index, child in self._by_bucket.items()}} if self._by_bucket else {}),
            "modules": {
                f"heads_q={slot[0]},heads_kv={slot[1]}{',int64' if len(slot) > 2 else ''}":
                {"origin": m.origin, "path": m.path, "seconds": round(m.seconds, 3)}
                for slot, m in self._modules.items()
            },
        }

    def __repr__(self) -> str:
        variant = "".join(f"{name}={value!r}, " for name, value in self.variant.items())
        return (f"tvmflash.Kernel(head_dim={self.head_dim}, dtype={self.dtype}, causal={self.causal}, {variant}"
                f"target={targets.describe(self.target)!r})")

    def __call__(self, q, k, v, *, softmax_scale=None, out=None, return_lse=False, alibi_slopes=None):
        """Attention of q over k, v. See the class docstring for the shapes."""
        check_flag("return_lse", return_lse)
        softmax_scale = resolve_softmax_scale(softmax_scale, self.head_dim)
        if torch.compiler.is_compiling():  # torch.compile traces a custom op, which calls back here at run time
            return ops.kernel_call(self, q, k, v, softmax_scale, out, return_lse, alibi_slopes)
        self._check(q, k, v, out)
        if self._by_bucket:  # another seqlen bucket's tuned knobs (``_bucket_kernels``)
            other = self._by_bucket.get(database.seqlen_bucket(k.shape[1]))
            if other is not None:
                return other(q, k, v, softmax_scale=softmax_scale, out=out, return_lse=return_lse,
                             alibi_slopes=alibi_slopes)
        variant_arguments = self.variant_arguments(q, alibi_slopes)
        # The module reads and writes through the tensors' own strides: none is copied, but where a
        # CUDA kernel's 16-byte vectors do not fit the strides (``_usable``).
        q, k, v = self._usable(q, "q"), self._usable(k, "k"), self._usable(v, "v")
        batch, seqlen_q, heads_q, _ = q.shape
        heads_kv = k.shape[2]
        given = out
        if out is None:
            out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        elif not self._fits(out):  # written to a compact tensor, then copied into out
            self._usable(out, "out", copy=False)
            out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        lse = torch.empty((batch, heads_q, seqlen_q), dtype=torch.float32, device=q.device)
        module = self._module_for(heads_q, heads_kv, q=q, k=k, v=v, out=out)
        if out.numel() and not k.shape[1]:
            # No key at all: every row sees none (0, and an LSE of -inf). Answered here, as the TMA
            # builds' tensor maps cannot describe an empty K or V.
            out.zero_()
            lse.fill_(-math.inf)
        elif out.numel():
            module.function(q, k, v, out, lse, softmax_scale, *variant_arguments)
        if given is not None and given is not out:
            out = given.copy_(out)
        return (out, lse) if return_lse else out

    def variant_arguments(self, q, alibi_slopes, batch: int | None = None) -> tuple:
        """The module's arguments after softmax_scale: the ALiBi slopes' (batch, heads_q) view if the
        kernel has ALiBi (then they are required), else none (then none may be given). batch: q's
        first dim, heads_q its third, unless given (varlen's count of sequences; heads_q q's second)."""
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

    def _check(self, q, k, v, out) -> None:
        """Types, shapes, dtypes and devices (what torch.compile's fake tensors have too). The
        common case is one test (this runs at every call); ``_explain`` says what is wrong."""
        want = self._torch_dtype
        try:
            qs, ks, device = q.shape, k.shape, q.device
            if (q.dtype is want and k.dtype is want and v.dtype is want and len(qs) == 4 and len(ks) == 4
                    and qs[3] == self.head_dim and ks == v.shape and ks[3] == self.head_dim and qs[0] == ks[0]
                    and ks[2] and not qs[2] % ks[2] and device.type == self._device_type and k.device == device
                    and v.device == device and (out is None or (isinstance(out, torch.Tensor) and out.shape == qs
                                                                and out.dtype is want and out.device == device))):
                return
        except (AttributeError, TypeError):
            pass
        self._explain(q, k, v, out)
        raise ValueError(f"q, k, v, out: unexpected arguments {q!r}, {k!r}, {v!r}, {out!r}")  # pragma: no cover

    def _check_tensors(self, named, layout: str = "(batch, seqlen, heads, head_dim)", dims: int = 4) -> None:
        """Each (name, tensor) of ``named`` is a torch.Tensor of the kernel's dtype, with ``dims``
        dims (``layout``) and head_dim last; the last two (k and v) have one shape."""
        for name, t in named:
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
        want = TORCH_DTYPES[self.dtype]
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

    def _explain(self, q, k, v, out) -> None:
        """Raise the error that says what is wrong with the arguments (``_check``'s slow path)."""
        self._check_tensors([("q", q), ("k", k), ("v", v)])
        if q.shape[0] != k.shape[0]:
            raise ValueError(f"k: expected batch {q.shape[0]} (from q), got shape {tuple(k.shape)}")
        self._explain_heads_and_places(q, k, v, out, heads_dim=2)

    def _explain_heads_and_places(self, q, k, v, out, heads_dim: int) -> None:
        """Raise the error that says what is wrong with the head counts (dim ``heads_dim``), the
        devices or out."""
        if k.shape[heads_dim] == 0 or q.shape[heads_dim] % k.shape[heads_dim]:
            raise ValueError(f"q: expected heads_q ({q.shape[heads_dim]}) to be a multiple of heads_kv "
                             f"({k.shape[heads_dim]})")
        for name, t in (("k", k), ("v", v)):
            if t.device != q.device:
                raise ValueError(f"{name}: expected device {q.device} (q's), got {t.device}")
        if q.device.type != self._device_type:
            raise ValueError(f"q: the kernel was built for {self._target_name}, got a tensor on {q.device}")
        if out is not None and (not isinstance(out, torch.Tensor) or out.shape != q.shape or out.dtype != q.dtype
                                or out.device != q.device):
            raise ValueError(f"out: expected a tensor of q's shape {tuple(q.shape)}, dtype and device, got "
                             f"{getattr(out, 'shape', out)!r}")

    def _fits(self, t) -> bool:
        """Can the module read or write ``t`` in place? Its last dim contiguous, its other strides
        multiples of the schedule's ``stride_multiple`` elements (16 bytes on CUDA, any on the CPU)
        and, on CUDA, not 0 (a TMA tensor map's stride may not be) and its data 16-byte aligned. Its
        size is no condition: past 2**31 elements the call takes the module that indexes in int64
        (``needs_int64``; its strides must be below 2**31, ``check_strides``). (b, s, h, d) tensors,
        (b, h, s, d) ones seen through a transpose and a packed qkv's thirds all fit, for every
        supported head_dim."""
        n3, (s0, s1, s2, s3) = t.shape[3], t.stride()
        multiple = self._stride_multiple
        return ((s3 == 1 or n3 <= 1) and not (s0 % multiple or s1 % multiple or s2 % multiple)
                and not (self._cuda and (t.data_ptr() % 16 or not (s0 and s1 and s2))))

    def _usable(self, t, name: str, copy: bool = True):
        """``t`` itself where the module can read it in place (``_fits``), else a compact copy (strides
        that are no whole 16-byte vectors on CUDA), else a ValueError that says why."""
        if not t.numel() or self._fits(t):
            return t
        if t.shape[3] > 1 and t.stride(3) != 1 and name != "out":
            raise ValueError(f"{name}: expected a contiguous last dim (stride 1), got strides {t.stride()}")
        if self._cuda and t.data_ptr() % 16 and name != "out":
            raise ValueError(f"{name}: expected a 16-byte aligned data pointer, got {t.data_ptr():#x}")
        return t.clone(memory_format=torch.contiguous_format) if copy else t


class VarlenKernel(Kernel):
    """FlashAttention forward over sequences packed without padding (flash-attn's varlen)::

        out, lse = kernel(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, return_lse=True)

    q: (total_q, heads_q, head_dim); k, v: (total_k, heads_kv, head_dim); cu_seqlens_q and
    cu_seqlens_k: int32 (batch + 1,) on q's device, non-decreasing from 0 to total_q (total_k):
    sequence b is rows cu_seqlens_q[b] .. cu_seqlens_q[b + 1] - 1 of q and cu_seqlens_k[b] ..
    cu_seqlens_k[b + 1] - 1 of k and v. max_seqlen_q: an int, at least every sequence's query
    count (it sizes the grid; rows past it are not computed). out has q's shape; lse is float32
    (heads_q, total_q), flash-attn 2's varlen layout. The kernel reads the offsets on the device:
    no padding, no loop over sequences, and new lengths need no rebuild. Causal masks, windows and
    ALiBi distances are per sequence (bottom-right aligned); ALiBi slopes are (heads_q,) or
    (batch, heads_q). The values of cu_seqlens are checked only on the CPU (on CUDA that would wait
    for the device).
    """

    def __call__(self, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, *, softmax_scale=None, out=None,
                 return_lse=False, alibi_slopes=None):
        """Attention of each packed sequence of q over its keys. See the class docstring."""
        check_flag("return_lse", return_lse)
        softmax_scale = resolve_softmax_scale(softmax_scale, self.head_dim)
        if torch.compiler.is_compiling():
            return ops.varlen_kernel_call(self, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, softmax_scale,
                                          out, return_lse, alibi_slopes)
        check_varlen(self, q, k, v, out, cu_seqlens_q, cu_seqlens_k, max_seqlen_q)
        total_q, heads_q, _ = q.shape
        heads_kv = k.shape[1]
        batch = cu_seqlens_q.shape[0] - 1
        variant_arguments = self.variant_arguments(q, alibi_slopes, batch)
        # The module takes the packed rows as one batch: (1, total, heads, head_dim) views, each made
        # once (a view costs a few microseconds of the host time a call takes).
        q4, k4, v4 = (self._usable(one_batch(t), name) for t, name in ((q, "q"), (k, "k"), (v, "v")))
        out4 = None if out is None else one_batch(out)
        in_place = out4 is not None and self._fits(out4)
        if not in_place:
            if out4 is not None:
                self._usable(out4, "out", copy=False)
            out4 = torch.empty(q4.shape, dtype=q.dtype, device=q.device)
        lse = torch.empty((1, heads_q, total_q), dtype=torch.float32, device=q.device)
        module = self._module_for(heads_q, heads_kv, q=q4, k=k4, v=v4, out=out4)
        if out4.numel() and not k4.shape[1]:  # no key at all (as Kernel.__call__)
            out4.zero_()
            lse.fill_(-math.inf)
        elif out4.numel() and batch:
            module.function(q4, k4, v4, out4, lse, softmax_scale, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                            *variant_arguments)
        if not in_place:  # out4 is a tensor of its own: the result, or copied into the given out
            out = out4[0] if out is None else out.copy_(out4[0])
        return (out, lse[0]) if return_lse else out


def check_varlen(kernel: Kernel, q, k, v, out, cu_seqlens_q, cu_seqlens_k, max_seqlen_q) -> None:
    """Types, shapes, dtypes and devices of a varlen call of ``kernel`` (what torch.compile's fake tensors have
    too); on the CPU the values of cu_seqlens as well."""
    kernel._check_tensors([("q", q), ("k", k), ("v", v)], "(total, heads, head_dim)", dims=3)
    kernel._explain_heads_and_places(q, k, v, out, heads_dim=1)
    check_cu_seqlens(cu_seqlens_q, cu_seqlens_k, q, k)
    check_max_seqlen("max_seqlen_q", max_seqlen_q)


def check_max_seqlen(name: str, value) -> int:
    """A max_seqlen argument: an int >= 0 (it sizes the grid on the host; torch.compile may trace it
    as a SymInt)."""
    if not isinstance(value, (int, torch.SymInt)) or isinstance(value, bool):
        raise TypeError(f"{name}: expected an int, got {value!r}")
    if value < 0:
        raise ValueError(f"{name}: expected an int >= 0, got {value}")
    return value


def check_cu_seqlens(cu_seqlens_q, cu_seqlens_k, q, k) -> None:
    """cu_seqlens_q and cu_seqlens_k: contiguous int32 (batch + 1,) tensors on q's device, of one
    length. On the CPU also their values: non-decreasing from 0 to q's (k's) row count; on CUDA
    reading them would wait for the device, so the kernel trusts them there."""
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
            if cu[0] != 0 or cu[-1] != rows.shape[0]:
                raise ValueError(f"{name}: expected offsets from 0 to {rows.shape[0]} (the packed rows), got "
                                 f"{cu[0].item()} .. {cu[-1].item()}")
            if cu.shape[0] > 1 and bool((cu[1:] < cu[:-1]).any()):
                raise ValueError(f"{name}: expected non-decreasing offsets, got {cu.tolist()}")
    if cu_seqlens_q.shape != cu_seqlens_k.shape:
        raise ValueError(f"cu_seqlens_k: expected the shape of cu_seqlens_q {tuple(cu_seqlens_q.shape)} (one "
                         f"offset per sequence), got {tuple(cu_seqlens_k.shape)}")


_KERNELS: dict[str, Kernel] = {}  # compile()'s, by kernel_key; forget_kernels() empties it
_BY_KEY: dict[str, Kernel] = {}  # the Kernel of each key a torch.compile'd graph may name (never emptied)


def kernel_key(spec_args: dict, target: tvm.target.Target, knobs: dict | None) -> str:
    """What names a Kernel: its spec, target and given knobs, and TVMFLASH_SM90 (it may change the
    schedule for the same target)."""
    return cache.digest([spec_args, str(target), knobs, schedule_registry.sm90_setting()])


def workload(spec_args: dict) -> dict:
    """What tuning records are keyed by: head_dim, dtype and causal (a variant runs the same tiles, so
    its kernel takes the knobs tuned for the plain workload)."""
    return {name: spec_args[name] for name in WORKLOAD_FIELDS}


def backward_workload(spec_args: dict) -> dict:
    """What the backward's tuning records are keyed by: the forward's workload and its pass."""
    return {**workload(spec_args), "pass": "backward"}


def by_key(key: str) -> Kernel:
    """The Kernel a custom op's ``kernel`` argument names (``Kernel.key``)."""
    return _BY_KEY[key]


def choose_schedule(target: tvm.target.Target, spec_args: dict,
                    knobs: dict | None) -> tuple[ModuleType, str, dict]:
    """The schedule module for a kernel, why, and the best records it read ({schedule name: record
    or None}, empty if it read none). ``schedules.for_target`` decides, except on sm_90a with
    TVMFLASH_SM90 unset and no knobs given: there this device's tuned records (``tvmflash tune`` or
    the shipped logs) of both schedules, measured at the same shape, pick the faster; without them
    the sm90 schedule serves every head_dim but those of ``sm90.SM80_HEAD_DIMS``. Given knobs keep
    the target's schedule, unless (on sm_90a, TVMFLASH_SM90 not 0) some are the sm90 schedule's
    alone: ``tvmflash tune`` and a user pass its records' knobs that way. varlen takes the
    same schedules: the sm90 schedule's TMA K/V boxes read past a sequence's last key into the next
    sequence (or, past the packed tensor's end, TMA's zeros), keys that the mask hides as it hides
    any key past the sequence's end, as FA3 does; its output and LSE stores are the program's,
    predicated on the sequence's rows."""
    module = schedule_registry.for_target(target, spec_args["dtype"])
    sm80, sm90 = schedule_registry.sm80, schedule_registry.sm90
    if (knobs and module is sm80 and schedule_registry.sm90_setting() != "off"
            and schedule_registry.sm90_eligible(target, spec_args["dtype"])
            and not set(knobs) <= set(sm80.KNOBS) and set(knobs) <= set(sm90.KNOBS)):
        return sm90, "the knobs' (knobs of the sm90 schedule only)", {}
    if (knobs or module is not sm80 or schedule_registry.sm90_setting() != "records"
            or not schedule_registry.sm90_eligible(target, spec_args["dtype"])):
        return module, "the target's", {}
    records = {name: database.lookup(target, name, workload(spec_args)) for name in ("sm80", "sm90")}
    r80, r90 = records["sm80"], records["sm90"]
    if not (r80 and r90 and r80.get("shape") == r90.get("shape")):
        if spec_args["head_dim"] in sm90.SM80_HEAD_DIMS:
            return module, (f"sm80's for head_dim {spec_args['head_dim']} on sm_90a (measured faster than sm90; "
                            "no tuning records of both schedules to compare)"), records
        return sm90, "sm_90a's (no tuning records of both schedules to compare)", records
    times = f"sm90 {r90['mean_ms']:.3f} ms, sm80 {r80['mean_ms']:.3f} ms at {r90.get('shape')}"
    return (sm90, f"tuned records: {times}", records) if r90["mean_ms"] <= r80["mean_ms"] else \
        (module, f"tuned records favour sm80: {times}", records)


def compile(*, head_dim: int, dtype, causal: bool = False, target=None, knobs: dict | None = None,
            heads_q: int | None = None, heads_kv: int | None = None, window_size=(-1, -1), softcap: float = 0.0,
            alibi: bool = False, varlen: bool = False) -> Kernel:  # noqa: A001 - the API's name
    """Compile FlashAttention forward and return a :class:`Kernel`.

    head_dim: 32, 64, 96, 128 or 256. dtype: "float16", "bfloat16", "float32" or the torch dtype.
    causal, window_size, softcap: flash-attn's (``resolve_variant``; one kernel per value); alibi:
    the kernel takes ALiBi slopes at each call; varlen: a :class:`VarlenKernel`, over sequences packed
    without padding (flash-attn's varlen). target: None (the current torch CUDA device if there
    is one, else the CPU), "cpu", "cuda", "sm80", "sm86", "sm89", "sm90", a ``tvm.target.Target``
    or a JSON dict. knobs: overrides of the
    schedule's knobs (``tvmflash.schedules.<arch>.KNOBS``). heads_q / heads_kv: build for these
    head counts now; otherwise each new head count is built at its first call.

    Modules are cached in memory and on disk (``$TVMFLASH_CACHE_DIR``, else ``~/.cache/tvmflash``).
    """
    dtype = dtype_name(dtype)
    variant = {**resolve_variant(causal, window_size, softcap, alibi), **varlen_field(varlen)}
    program.AttentionSpec(head_dim, dtype, **variant)  # validates head_dim and dtype
    resolved = targets.resolve(target)
    # TVMFLASH_SM90 is in the key: it may change the schedule for the same target. The records
    # that choose_schedule reads are read once, when the Kernel is made (as its tuned knobs are):
    # compile() runs on every tvmflash.attention call, so a cached one reads no file.
    spec_args = {"head_dim": head_dim, "dtype": dtype, **variant}
    key = kernel_key(spec_args, resolved, knobs)
    kernel = _KERNELS.get(key)
    if kernel is None:
        kernel = _KERNELS[key] = (VarlenKernel if varlen else Kernel)(spec_args, resolved, knobs)
    if heads_q is not None:
        kernel.module(heads_q, heads_kv if heads_kv is not None else heads_q)
    return kernel


def forget_kernels() -> None:
    """Drop the in-memory Kernels, so the next ``compile()`` looks up tuned knobs afresh (after
    ``tvmflash tune`` wrote new ones). Built modules stay cached."""
    _KERNELS.clear()
    ops.KERNELS_FOR.clear()


def dtype_name(dtype) -> str:
    for name, torch_dtype in TORCH_DTYPES.items():
        if dtype in (name, torch_dtype):
            return name
    raise TypeError(f"dtype: expected one of {list(TORCH_DTYPES)} or the torch dtype, got {dtype!r}")


def _version() -> str:
    from tvmflash import __version__

    return __version__


# ----------------------------------------------------------------------------- the backward pass
def _row_values(rows: tuple, device) -> tuple:
    """delta and lse2 for the backward's programs: float32 of shape ``rows`` (batch, heads_q,
    seqlen_q), each head's rows ``program_backward.padded_rows`` apart."""
    *outer, seqlen_q = rows
    return tuple(torch.empty((*outer, program_backward.padded_rows(seqlen_q)), dtype=torch.float32,
                             device=device)[..., :seqlen_q] for _ in range(2))


class BackwardKernel(Kernel):
    """FlashAttention backward for one (head_dim, dtype, causal, variant, target): the three programs of
    ``tvmflash.program_backward`` (delta, dkdv, dq) built into one module per pair of head
    counts, scheduled by the target's ``schedule_backward`` and cached like the forward's::

        dq, dk, dv = kernel(q, k, v, out, dout, lse)              # dlse=None: lse unused by the loss
        dq, dk, dv = kernel(q, k, v, out, dout, lse, alibi_slopes=slopes)  # a kernel with ALiBi

    q, out, dout: (batch, seqlen_q, heads_q, head_dim); k, v: (batch, seqlen_k, heads_kv,
    head_dim); lse, dlse: float32 (batch, heads_q, seqlen_q), the forward's. dq, dk, dv have the
    shapes and dtype of q, k and v (dk, dv summed over each GQA group's query heads). The
    gradients are bitwise the same from run to run unless the knob ``dq_atomic`` sums dq by fp32
    atomics (``program_backward``): sm90's default, where that measures faster. ``deterministic``
    (``compile_backward``) turns it off.
    """

    PASS = "backward"

    def __init__(self, spec_args: dict, target: tvm.target.Target, knobs: dict | None, deterministic: bool = False):
        self._set_problem(spec_args, target)
        self.schedule = schedule_registry.backward_for_target(target, self.dtype, self.head_dim)
        self.schedule_source = "the target's"
        self._stride_multiple = program.stride_multiple(schedule_registry.stride_alignment(self.schedule), self.dtype)
        schedule_name = schedule_registry.name_of(self.schedule)
        self._check_knob_names(knobs, self.schedule.BACKWARD_KNOBS, "backward ")
        defaults = backward_default_knobs(self.schedule, self.head_dim)
        # the caller's knobs, else those `tvmflash tune --pass backward` stored for this GPU (dense
        # kernels: varlen keeps the defaults), else the defaults
        tuned = None if knobs or self.variant.get("varlen") else database.lookup(
            target, schedule_name, backward_workload(spec_args))
        if self.variant.get("varlen"):
            defaults.update(getattr(self.schedule, "BACKWARD_VARLEN_KNOBS_FOR_HEAD_DIM", {}).get(self.head_dim, {}))
        self._take_knobs(defaults, tuned, knobs)
        if self.variant.get("varlen") and self.knobs.get("dkdv_copy") == "tma":
            raise ValueError("knobs: dkdv_copy 'tma' reads the rows past a sequence's end, which varlen packs with the "
                             "next sequence's: the varlen backward takes dkdv_copy 'cp.async'")
        if deterministic and self.dq_atomic:  # the dq pass instead: one sum a dq element, in a fixed order
            if (knobs or {}).get("dq_atomic"):
                raise ValueError("knobs: dq_atomic sums dq by fp32 atomics, in an order that changes from run to "
                                 "run, and deterministic=True asks for bitwise-equal gradients: leave one out")
            self.knobs["dq_atomic"] = False
        check = getattr(self.schedule, "backward_knobs_problem", None)
        problem = check(self.head_dim, self.dtype, self.knobs) if check and targets.is_cuda(target) else None
        if problem:
            raise ValueError(problem)
        needs = getattr(self.schedule, "backward_shared_memory_bytes", None)
        if needs and targets.is_cuda(target):
            need = needs(self.head_dim, self.dtype, self.knobs)
            limit = min(int(target.attrs.get("max_shared_memory_per_block", 48 * 1024)),
                        getattr(self.schedule, "BACKWARD_SHARED_MEMORY_LIMIT", math.inf))
            if need > limit:
                raise ValueError(f"knobs: {self.knobs} need {need / 1024:.0f} KiB of shared memory, the "
                                 f"{schedule_name} backward on {targets.describe(target)} has {limit / 1024:.0f} KiB; "
                                 "try a smaller block_m or block_n")
        self._modules: dict[tuple[int, int], _Module] = {}
        self._last: tuple[int, int] | None = None

    def _key(self, spec: AttentionSpec, wide: bool = False) -> str:
        # schedules/cuda.py: the tensor-core schedules run delta and convert_dq on its SIMT schedule
        return cache.digest({"pass": self.PASS, "like the forward's": super()._key(spec, wide),
                             "code": cache.source_digest(program_backward, schedule_registry.cuda)})

    def _scheduled(self, spec: AttentionSpec) -> tvm.s_tir.Schedule:
        knobs = self.knobs
        sch = tvm.s_tir.Schedule(program_backward.attention_backward(
            spec, knobs["block_m"], knobs["block_n"], knobs.get("dq_block_m"), knobs.get("dq_block_n"),
            dq_atomic=self.dq_atomic, stride_alignment=schedule_registry.stride_alignment(self.schedule)))
        return self.schedule.schedule_backward(sch, **self.knobs)

    @property
    def dq_atomic(self) -> bool:
        """dq summed by fp32 atomics from dkdv (then not bitwise reproducible), or by a pass of its own."""
        return bool(self.knobs.get("dq_atomic", False))

    def _entry(self, module):
        """The three programs to call, by name (``program_backward.programs``)."""
        return {name: module[name] for name in program_backward.programs(self.dq_atomic)}

    def _dq_accumulator(self, q) -> tuple:
        """With ``dq_atomic``: (dq_accum,), zeros of ``program_backward``'s shape for q (batch,
        seqlen_q, heads_q, head_dim); else ()."""
        if not self.dq_atomic:
            return ()
        batch, seqlen_q, heads_q, head_dim = q.shape
        rows = program_backward.dq_accumulator_rows(seqlen_q, self.knobs["block_m"])
        return (torch.zeros((batch, rows, heads_q, head_dim), dtype=torch.float32, device=q.device),)

    def _dq(self, passes, accumulator, q, k, v, dout, lse2, delta, dq, softmax_scale, *arguments):
        """dq: from dkdv's sum (``accumulator``: convert_dq) or by the dq pass."""
        if accumulator:
            passes["convert_dq"](*accumulator, dq, softmax_scale)
        else:
            passes["dq"](q, k, v, dout, lse2, delta, dq, softmax_scale, *arguments)

    def info(self) -> dict:
        return {**super().info(), "pass": self.PASS}

    def __repr__(self) -> str:
        return "tvmflash.BackwardKernel" + super().__repr__().removeprefix("tvmflash.Kernel")

    def _check_gradient_arguments(self, q, k, v, out, dout, lse, dlse, dq, dk, dv, rows) -> None:
        """out and dout of q's shape and dtype, lse and dlse (None: 0) float32 of shape ``rows``, and
        dq, dk, dv (None: new) of q's, k's and v's and contiguous, all on q's device."""
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

    def _readable(self, t, strided: bool = True):
        """``t`` itself where the programs can read it in place, else a compact copy. q, k and v
        (``strided``) are read through their strides (``_fits``: a packed qkv's thirds, a
        transposed (b, h, s, d) tensor); out, dout and lse must be compact. A CUDA tensor whose
        data is off the 16 bytes vector loads need is copied too."""
        fits = self._fits(t) if strided else t.is_contiguous() and not (self._cuda and t.data_ptr() % 16)
        return t if fits or not t.numel() else t.clone(memory_format=torch.contiguous_format)

    def _gradients_and_passes(self, q, k, v, out, dout, dq, dk, dv, heads_q: int, heads_kv: int, work: bool):
        """dq, dk, dv (new where not given, compact) and the programs that fill them
        (``program_backward.programs`` by name); without ``work`` (no query or no key) the gradients
        are 0 and there are no programs."""
        grads = tuple(torch.empty(t.shape, dtype=t.dtype, device=t.device) if g is None else g
                      for t, g in ((q, dq), (k, dk), (v, dv)))
        if not work:
            for grad in grads:
                grad.zero_()
            return grads, None
        # dq, dk, dv, out and dout are compact, of q's, k's and v's sizes; q, k and v may have any strides
        return grads, self._module_for(heads_q, heads_kv, q=q, k=k, v=v, out=out, dout=dout).function

    def __call__(self, q, k, v, out, dout, lse, *, dlse=None, softmax_scale=None, dq=None, dk=None, dv=None,
                 alibi_slopes=None):
        """(dq, dk, dv) of attention(q, k, v) = out (with its lse), given dout = ∂L/∂out and
        dlse = ∂L/∂lse (None: 0). Pass dq, dk, dv to have them written in place. See the class
        docstring for the shapes; out and lse are those of the forward of the same variant (and
        ALiBi slopes)."""
        self._check(q, k, v, None)
        variant_arguments = self.variant_arguments(q, alibi_slopes)
        batch, seqlen_q, heads_q, _ = q.shape
        heads_kv = k.shape[2]
        rows = (batch, heads_q, seqlen_q)
        self._check_gradient_arguments(q, k, v, out, dout, lse, dlse, dq, dk, dv, rows)
        softmax_scale = resolve_softmax_scale(softmax_scale, self.head_dim)
        q, k, v = map(self._readable, (q, k, v))
        out, dout, lse = (self._readable(t, strided=False) for t in (out, dout, lse))
        (dq, dk, dv), passes = self._gradients_and_passes(q, k, v, out, dout, dq, dk, dv, heads_q, heads_kv,
                                                          work=bool(q.numel() and k.numel()))
        if passes is None:
            return dq, dk, dv
        delta, lse2 = _row_values(rows, q.device)
        dlse = torch.zeros(rows, dtype=torch.float32, device=q.device) if dlse is None else dlse.contiguous()
        accumulator = self._dq_accumulator(q)
        passes["delta"](out, dout, lse, dlse, delta, lse2)
        passes["dkdv"](q, k, v, dout, lse2, delta, dk, dv, softmax_scale, *accumulator, *variant_arguments)
        self._dq(passes, accumulator, q, k, v, dout, lse2, delta, dq, softmax_scale, *variant_arguments)
        return dq, dk, dv


class VarlenBackwardKernel(BackwardKernel):
    """The backward of a :class:`VarlenKernel` (flash-attn's varlen: sequences packed without
    padding)::

        dq, dk, dv = kernel(q, k, v, out, dout, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)

    q, out, dout, dq: (total_q, heads_q, head_dim); k, v, dk, dv: (total_k, heads_kv, head_dim);
    lse, dlse: float32 (heads_q, total_q), the forward's; cu_seqlens and max_seqlen_q as the
    forward's, and max_seqlen_k, an int at least every sequence's key count (it sizes dkdv's grid).
    """

    def __call__(self, q, k, v, out, dout, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *,
                 dlse=None, softmax_scale=None, dq=None, dk=None, dv=None, alibi_slopes=None):
        """(dq, dk, dv) of the varlen attention(q, k, v) = out (with its lse); see
        ``BackwardKernel.__call__`` and the class docstring."""
        check_varlen(self, q, k, v, None, cu_seqlens_q, cu_seqlens_k, max_seqlen_q)
        check_max_seqlen("max_seqlen_k", max_seqlen_k)
        batch = cu_seqlens_q.shape[0] - 1
        variant_arguments = self.variant_arguments(q, alibi_slopes, batch)
        total_q, heads_q, _ = q.shape
        heads_kv = k.shape[1]
        rows = (heads_q, total_q)
        self._check_gradient_arguments(q, k, v, out, dout, lse, dlse, dq, dk, dv, rows)
        softmax_scale = resolve_softmax_scale(softmax_scale, self.head_dim)
        q, k, v = (self._readable(one_batch(t))[0] for t in (q, k, v))
        out, dout, lse = (self._readable(t, strided=False) for t in (out, dout, lse))
        (dq, dk, dv), passes = self._gradients_and_passes(q, k, v, out, dout, dq, dk, dv, heads_q, heads_kv,
                                                          work=bool(q.numel() and k.numel() and batch))
        if passes is None:
            return dq, dk, dv
        delta, lse2 = _row_values((1, *rows), q.device)
        dlse = torch.zeros((1, *rows), dtype=torch.float32, device=q.device) if dlse is None else dlse.contiguous()[None]
        # the packed rows as the programs' one batch
        q, k, v, out, dout, lse, dq4, dk4, dv4 = map(one_batch, (q, k, v, out, dout, lse, dq, dk, dv))
        sequences = (cu_seqlens_q, cu_seqlens_k)
        accumulator = self._dq_accumulator(q)
        passes["delta"](out, dout, lse, dlse, delta, lse2)
        passes["dkdv"](q, k, v, dout, lse2, delta, dk4, dv4, softmax_scale, *accumulator, *sequences, max_seqlen_k,
                       *variant_arguments)
        self._dq(passes, accumulator, q, k, v, dout, lse2, delta, dq4, softmax_scale, *sequences, max_seqlen_q,
                 *variant_arguments)
        return dq, dk, dv


def compile_backward(*, head_dim: int, dtype, causal: bool = False, target=None, knobs: dict | None = None,
                     heads_q: int | None = None, heads_kv: int | None = None, window_size=(-1, -1),
                     softcap: float = 0.0, alibi: bool = False, varlen: bool = False,
                     deterministic: bool = False) -> BackwardKernel:
    """Compile the FlashAttention backward and return a :class:`BackwardKernel` (varlen: a
    :class:`VarlenBackwardKernel`). The arguments are :func:`compile`'s; knobs override the
    schedule's ``BACKWARD_KNOBS``. deterministic: gradients bitwise the same from run to run (dq by
    a pass of its own even where the schedule's default sums it by atomics, the knob ``dq_atomic``)."""
    dtype = dtype_name(dtype)
    variant = {**resolve_variant(causal, window_size, softcap, alibi), **varlen_field(varlen)}
    program.AttentionSpec(head_dim, dtype, **variant)  # validates head_dim and dtype
    resolved = targets.resolve(target)
    spec_args = {"head_dim": head_dim, "dtype": dtype, **variant}
    key = cache.digest(["backward", spec_args, str(resolved), knobs, schedule_registry.backward_setting(),
                        schedule_registry.sm90_setting(), deterministic])
    kernel = _KERNELS.get(key)
    if kernel is None:
        kernel = _KERNELS[key] = (VarlenBackwardKernel if varlen else BackwardKernel)(spec_args, resolved, knobs,
                                                                                      deterministic)
    if heads_q is not None:
        kernel.module(heads_q, heads_kv if heads_kv is not None else heads_q)
    return kernel


from tvmflash import ops  # noqa: E402 - Kernel.__call__ traces through its custom ops (ops imports this module)
