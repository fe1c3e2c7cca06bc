"""The FP8 (e4m3) forward kernel: FlashAttention-3's FP8 forward for one (head_dim, causal, target), called on
torch tensors (``program_forward`` with ``AttentionSpec.fp8``, a schedule's ``Fp8Forward``)."""

from __future__ import annotations

import math
import os

import torch
import tvm

from tvmflash import cache, choice, lowering, program
from tvmflash import schedules as schedule_registry
from tvmflash import target as targets
from tvmflash.kernels.build import PROGRAMS, Build
from tvmflash.kernels.checks import (check_cu_seqlens, check_descale, check_flag, check_max_seqlen, fits_in_place,
                                     resolve_softmax_scale)
from tvmflash.kernels.forward import kernel_build_options
from tvmflash.program import FP8, AttentionSpec

FP8_TORCH = torch.float8_e4m3fn
OUTPUT_TORCH = torch.bfloat16


def fp8_schedule(target: tvm.target.Target, schedule: str | None = None):
    """The schedule that runs the FP8 forward on ``target``: the first of ``SCHEDULES`` (or the one named)
    that runs on it and has an ``fp8_forward``; a NotImplementedError where none has."""
    names = [schedule] if schedule else list(schedule_registry.SCHEDULES)
    for name in names:
        if name not in schedule_registry.SCHEDULES:
            raise ValueError(f"schedule: expected one of {list(schedule_registry.SCHEDULES)}, got {name!r}")
        found = schedule_registry.SCHEDULES[name]
        if found.fp8_forward is not None and choice.target_problem(found, target) is None:
            return found
    raise NotImplementedError(f"the FP8 (e4m3) forward runs on sm90 (H100, H200) alone; {targets.describe(target)} "
                              f"has no FP8 schedule{f' named {schedule!r}' if schedule else ''}")


def transposed_v(v: torch.Tensor, keys: int) -> torch.Tensor:
    """V (batch, seqlen_k, heads_kv, head_dim) as the FP8 program reads it: (batch, heads_kv, head_dim, keys),
    keys contiguous, zero from seqlen_k on (``program_forward``'s module docstring). One copy: FA3
    transposes in shared memory instead."""
    batch, seqlen_k, heads_kv, head_dim = v.shape
    vt = torch.empty((batch, heads_kv, head_dim, keys), dtype=v.dtype, device=v.device)
    vt[..., seqlen_k:].view(torch.uint8).zero_()  # (e4m3's zero is the zero byte)
    vt[..., :seqlen_k].copy_(v.permute(0, 2, 3, 1))
    return vt


def packed_transposed_v(v: torch.Tensor, cu_seqlens_k: torch.Tensor, keys: int) -> torch.Tensor:
    """varlen's V (total_k, heads_kv, head_dim) as the FP8 program reads it: (1, heads_kv, head_dim, keys),
    sequence b's keys from column ``program.fp8_v_first`` on, aligned for the schedules' 16-byte copies
    wherever cu_seqlens_k puts it, zero elsewhere. Computed on v's device, with no synchronisation."""
    total_k, heads_kv, head_dim = v.shape
    vt = torch.zeros((1, heads_kv, head_dim, keys), dtype=torch.uint8, device=v.device)  # (e4m3's zero)
    cu = cu_seqlens_k.to(torch.int64)
    token = torch.arange(total_k, device=v.device)
    sequence = torch.searchsorted(cu[1:], token, right=True)  # each key's (empty sequences skipped)
    first = cu[sequence]
    vt[0].index_copy_(2, token - first + program.fp8_v_first(first, sequence), v.view(torch.uint8).permute(1, 2, 0))
    return vt.view(v.dtype)


class Fp8Kernel:
    """FlashAttention-3's FP8 forward for one (head_dim, causal, target)::

        out = kernel(q, k, v, q_descale, k_descale, v_descale)
        out, lse = kernel(q, k, v, q_descale, k_descale, v_descale, return_lse=True)

    q: (batch, seqlen_q, heads_q, head_dim), k, v: (batch, seqlen_k, heads_kv, head_dim), all
    torch.float8_e4m3fn; the descales float32 (batch, heads_kv) (None: ones), FA3's: the scores are
    q·k · q_descale · k_descale · softmax_scale, P is quantised to e4m3 for P V, and the output is
    multiplied by v_descale. out: bf16 (batch, seqlen_q, heads_q, head_dim); lse float32 (batch,
    heads_q, seqlen_q), of the descaled scores. heads_q must be a multiple of heads_kv (GQA, MQA).
    Forward only. On sm90 (``schedules.sm90.forward_fp8``); the CPU schedule runs the same program for
    the tests. knobs: the caller's over the schedule's (``Fp8Forward.knobs``), e.g. to compare them.
    """

    varlen = False  # Fp8VarlenKernel: the packed sequences' program

    def __init__(self, head_dim: int, causal: bool = False, target=None, schedule: str | None = None,
                 knobs: dict | None = None):
        self.target = targets.resolve(target)
        self.schedule = fp8_schedule(self.target, schedule)
        fp8 = self.schedule.fp8_forward
        if head_dim not in fp8.head_dims:
            raise NotImplementedError(f"the {self.schedule.name} FP8 forward takes head_dim {fp8.head_dims}, got "
                                      f"{head_dim}")
        problem = choice.unchecked_problem(f"the {self.schedule.name} FP8 forward", head_dim, fp8.unchecked_head_dims)
        if problem:
            raise NotImplementedError(problem)
        self.head_dim, self.causal = head_dim, check_flag("causal", causal)
        # the caller's over this GPU's tuning record (``tvmflash tune --dtype float8_e4m3fn``) over the defaults
        chosen = choice.fp8_forward(self.target, self.schedule, head_dim, self.causal, knobs)
        self.knobs, self.knobs_source, self.record = chosen.knobs, chosen.knobs_source, chosen.record
        self.min_kv_tiles = self.schedule.min_kv_tiles(self.knobs)
        self.stride_multiple = program.stride_multiple(self.schedule.stride_alignment, FP8)
        # where the target has no FP8 conversion of its own, exact ones by the bits (``program_e4m3``); in the key,
        # as a choice made outside the programs' and schedules' sources (as decode's)
        self.e4m3_bits = not targets.converts_fp8(self.target)
        self.build = Build(kind="forward", target=self.target, schedule=self.schedule, knobs=self.knobs, variant={},
                           spec=self.spec, programs=self._scheduled, entry=lambda module: module["main"],
                           code=(*PROGRAMS, *self.schedule.sources, *lowering.MODULES),
                           options=kernel_build_options(self.schedule, {"varlen": self.varlen}),
                           key_fields={"fp8": True, "e4m3 conversion": "bits" if self.e4m3_bits else "cast"})

    def spec(self, heads_q: int, heads_kv: int) -> AttentionSpec:
        return AttentionSpec(self.head_dim, FP8, self.causal, heads_q, heads_kv, varlen=self.varlen)

    def _scheduled(self, spec: AttentionSpec) -> tvm.s_tir.Schedule:
        program_func = schedule_registry.program_for(spec, self.schedule, self.knobs, e4m3_bits=self.e4m3_bits)
        sch = tvm.s_tir.Schedule(program_func)
        return self.schedule.fp8_forward.apply(sch, **self.knobs)

    def source(self, heads_q: int = 1, heads_kv: int | None = None) -> str:
        """The generated CUDA source for these head counts."""
        return self.build.source(heads_q, heads_kv if heads_kv is not None else heads_q)

    def info(self) -> dict:
        """What this kernel is: its schedule, knobs, target and modules."""
        return {"schedule": self.schedule.name, "knobs": dict(self.knobs), "knobs_source": self.knobs_source,
                "target": targets.describe(self.target), "modules": self.build.info()}

    def __repr__(self) -> str:
        return (f"tvmflash.kernels.fp8.Fp8Kernel(head_dim={self.head_dim}, causal={self.causal}, "
                f"target={targets.describe(self.target)!r})")

    def _usable(self, t: torch.Tensor) -> torch.Tensor:
        """t, or a compact copy where the module cannot read it in place (``checks.fits_in_place``: a view
        at an odd offset is compact, and ``contiguous`` would keep it)."""
        return t if fits_in_place(t, self.stride_multiple, cuda=True) else t.clone(memory_format=torch.contiguous_format)

    def _check(self, q, k, v, dims: int, layout: str):
        """q, k, v: e4m3 tensors of ``dims`` dims (``layout``) on the kernel's device, of its head_dim, k's
        and v's shapes equal, heads_q a multiple of heads_kv; none requires grad."""
        for name, t in (("q", q), ("k", k), ("v", v)):
            if not isinstance(t, torch.Tensor) or t.dtype != FP8_TORCH:
                raise TypeError(f"{name}: expected a torch.float8_e4m3fn tensor, got "
                                f"{getattr(t, 'dtype', type(t).__name__)}")
            if t.dim() != dims:
                raise ValueError(f"{name}: expected {dims} dims {layout}, got {tuple(t.shape)}")
            if t.device != q.device:
                raise ValueError(f"{name}: expected a tensor on {q.device}, got {t.device}")
        if q.shape[-1] != self.head_dim:
            raise ValueError(f"q: expected head_dim {self.head_dim} (the kernel's), got {q.shape[-1]}")
        if k.shape != v.shape or k.shape[-1] != self.head_dim or k.shape[:-3] != q.shape[:-3]:
            raise ValueError(f"k, v: expected {layout} as q's, got {tuple(k.shape)} and {tuple(v.shape)}")
        if q.shape[-2] % k.shape[-2]:
            raise ValueError(f"q's heads ({q.shape[-2]}) must be a multiple of k's and v's ({k.shape[-2]})")
        if (q.device.type == "cuda") != targets.is_cuda(self.target):
            raise ValueError(f"q: expected a tensor for {targets.describe(self.target)}, got one on {q.device}")
        if torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v)):
            raise NotImplementedError("the FP8 forward has no backward: call it on tensors that require no grad, "
                                      "or under torch.no_grad()")

    def _descales(self, descales, batch: int, heads_kv: int, device) -> list:
        return [check_descale(name, d, batch, heads_kv, device)
                for name, d in zip(("q_descale", "k_descale", "v_descale"), descales)]

    def _keys(self, seqlen_k: int) -> int:
        """The length of the transposed V the module reads (``transposed_v``): every tile it visits."""
        block_n = self.knobs["block_n"]
        return max(math.ceil(seqlen_k / block_n), self.min_kv_tiles) * block_n

    @staticmethod
    def _out(out, shape, device):
        if out is None:
            return torch.empty(shape, dtype=OUTPUT_TORCH, device=device)
        if (not isinstance(out, torch.Tensor) or out.dtype != OUTPUT_TORCH or tuple(out.shape) != tuple(shape)
                or not out.is_contiguous() or out.device != device):
            raise ValueError(f"out: expected a compact bf16 tensor of shape {tuple(shape)} on {device}")
        return out

    def __call__(self, q, k, v, q_descale=None, k_descale=None, v_descale=None, *, softmax_scale=None,
                 return_lse=False, out=None):
        """Attention of q over k, v in FP8. See the class docstring for the shapes. out: where to write the
        output (bf16, compact, q's shape), else a new tensor."""
        return_lse = check_flag("return_lse", return_lse)
        softmax_scale = resolve_softmax_scale(softmax_scale, self.head_dim)
        self._check(q, k, v, 4, "(batch, seqlen, heads, head_dim)")
        batch, seqlen_q, heads_q, head_dim = q.shape
        _, seqlen_k, heads_kv, _ = k.shape
        descales = self._descales((q_descale, k_descale, v_descale), batch, heads_kv, q.device)
        shape = (batch, seqlen_q, heads_q, head_dim)
        out = self._out(out, shape, q.device)
        lse = torch.empty((batch, heads_q, seqlen_q), dtype=torch.float32, device=q.device)
        if not out.numel():
            return (out, lse) if return_lse else out
        if not seqlen_k:  # no key: every row sees none
            out.zero_()
            lse.fill_(-math.inf)
            return (out, lse) if return_lse else out
        q, k = self._usable(q), self._usable(k)
        vt = transposed_v(v, self._keys(seqlen_k))
        module = self.build.module_for(heads_q, heads_kv, q=q, k=k, v=vt, out=out)
        module.function(q, k, vt, out, lse, softmax_scale, *descales)
        return (out, lse) if return_lse else out


class Fp8VarlenKernel(Fp8Kernel):
    """The FP8 forward over sequences packed without padding (flash-attn's varlen)::

        out, lse = kernel(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, q_descale, k_descale, v_descale,
                          return_lse=True)

    q: (total_q, heads_q, head_dim), k, v: (total_k, heads_kv, head_dim), e4m3; cu_seqlens_q, cu_seqlens_k
    and max_seqlen_q as ``kernels.varlen.VarlenKernel``'s; the descales float32 (batch, heads_kv), batch the
    number of sequences (None: ones). out: bf16 (total_q, heads_q, head_dim); lse: float32 (heads_q,
    total_q). The transposed V holds every sequence's keys from an aligned column (``packed_transposed_v``)."""

    varlen = True

    def __call__(self, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, q_descale=None, k_descale=None,
                 v_descale=None, *, softmax_scale=None, return_lse=False, out=None):
        """Attention of each packed sequence of q over its keys in FP8. See the class docstring."""
        return_lse = check_flag("return_lse", return_lse)
        softmax_scale = resolve_softmax_scale(softmax_scale, self.head_dim)
        self._check(q, k, v, 3, "(total, heads, head_dim)")
        max_seqlen_q = check_max_seqlen("max_seqlen_q", max_seqlen_q)
        check_cu_seqlens(cu_seqlens_q, cu_seqlens_k, q, k, max_seqlen_q)
        total_q, heads_q, head_dim = q.shape
        total_k, heads_kv, _ = k.shape
        batch = cu_seqlens_q.shape[0] - 1
        descales = self._descales((q_descale, k_descale, v_descale), batch, heads_kv, q.device)
        out = self._out(out, q.shape, q.device)
        lse = torch.empty((1, heads_q, total_q), dtype=torch.float32, device=q.device)
        if out.numel() and not total_k:  # no key at all
            out.zero_()
            lse.fill_(-math.inf)
        elif out.numel() and batch:
            # every sequence's aligned keys (``program.fp8_v_first``: FP8_V_ALIGN more a sequence at most), and
            # past the last one's end a tile more than the longest step a sequence's tiles take
            keys = self._keys(total_k + program.FP8_V_ALIGN * batch) + self.knobs["block_n"] * max(1, self.min_kv_tiles)
            q4, k4 = self._usable(q[None]), self._usable(k[None])
            vt = packed_transposed_v(v, cu_seqlens_k, keys)
            module = self.build.module_for(heads_q, heads_kv, q=q4, k=k4, v=vt, out=out[None])
            module.function(q4, k4, vt, out[None], lse, softmax_scale, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                            *descales)
        return (out, lse[0]) if return_lse else out


_KERNELS: dict[str, Fp8Kernel] = {}


def fp8_kernel(head_dim: int, causal: bool, target=None, schedule: str | None = None,
               varlen: bool = False, knobs: dict | None = None) -> Fp8Kernel:
    """The FP8 kernel (varlen: ``Fp8VarlenKernel``) for these, built once a process (its modules are cached
    on disk as every kernel's); knobs: the caller's (None: a tuning record's or the defaults,
    ``choice.fp8_forward``)."""
    resolved = targets.resolve(target)
    # (the environment's TVMFLASH_GPU_UNCHECKED too: a kernel served under it is not served once it is unset)
    key = cache.digest([head_dim, causal, str(resolved), schedule, varlen, os.environ.get(choice.GPU_UNCHECKED),
                        knobs])
    if key not in _KERNELS:
        _KERNELS[key] = (Fp8VarlenKernel if varlen else Fp8Kernel)(head_dim, causal, resolved, schedule, knobs)
    return _KERNELS[key]


def forget() -> None:
    """Drop the kernels ``fp8_kernel`` keeps, so the next one looks up its tuned knobs afresh."""
    _KERNELS.clear()
