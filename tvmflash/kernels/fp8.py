"""The FP8 (e4m3) forward kernel: FlashAttention-3's FP8 forward for one (head_dim, causal, target), called on
torch tensors (``program_forward`` with ``AttentionSpec.fp8``, a schedule's ``Fp8Forward``)."""

from __future__ import annotations

import math

import torch
import tvm

from tvmflash import cache, lowering, program
from tvmflash import schedules as schedule_registry
from tvmflash import target as targets
from tvmflash.kernels.build import Build
from tvmflash.kernels.checks import check_flag, resolve_softmax_scale
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
        if found.fp8_forward is not None and _runs_on(found, target):
            return found
    raise NotImplementedError(f"the FP8 (e4m3) forward runs on sm90 (H100, H200) alone; {targets.describe(target)} "
                              f"has no FP8 schedule{f' named {schedule!r}' if schedule else ''}")


def _runs_on(schedule, target: tvm.target.Target) -> bool:
    """Does ``schedule`` run on ``target`` (its kind, compute capability, CPU features)?"""
    if target.kind.name != schedule.target_kind:
        return False
    cc = targets.compute_capability(target) or 0
    if (schedule.compute_capabilities is not None and cc not in schedule.compute_capabilities) or \
            (schedule.min_compute_capability is not None and cc < schedule.min_compute_capability):
        return False
    return not schedule.cpu_features or targets.llvm_has_features(target, schedule.cpu_features)


def transposed_v(v: torch.Tensor, keys: int) -> torch.Tensor:
    """V (batch, seqlen_k, heads_kv, head_dim) as the FP8 program reads it: (batch, heads_kv, head_dim, keys),
    keys contiguous, zero from seqlen_k on (``program_forward``'s module docstring). One copy: FA3
    transposes in shared memory instead."""
    batch, seqlen_k, heads_kv, head_dim = v.shape
    vt = torch.empty((batch, heads_kv, head_dim, keys), dtype=v.dtype, device=v.device)
    vt[..., seqlen_k:].view(torch.uint8).zero_()  # (e4m3's zero is the zero byte)
    vt[..., :seqlen_k].copy_(v.permute(0, 2, 3, 1))
    return vt


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

    def __init__(self, head_dim: int, causal: bool = False, target=None, schedule: str | None = None,
                 knobs: dict | None = None):
        self.target = targets.resolve(target)
        self.schedule = fp8_schedule(self.target, schedule)
        fp8 = self.schedule.fp8_forward
        if head_dim not in fp8.head_dims:
            raise NotImplementedError(f"the {self.schedule.name} FP8 forward takes head_dim {fp8.head_dims}, got "
                                      f"{head_dim}")
        self.head_dim, self.causal = head_dim, check_flag("causal", causal)
        self.knobs = {**fp8.knobs(head_dim), **(knobs or {})}  # the schedule's, or the caller's over them
        self.min_kv_tiles = self.schedule.min_kv_tiles(self.knobs)
        self.stride_multiple = program.stride_multiple(self.schedule.stride_alignment, FP8)
        self.build = Build(kind="forward", target=self.target, schedule=self.schedule, knobs=self.knobs, variant={},
                           spec=self.spec, programs=self._scheduled, entry=lambda module: module["main"],
                           code=(program, *self.schedule.sources, *lowering.MODULES),
                           options=self.schedule.build_options("forward"), key_fields={"fp8": True})

    def spec(self, heads_q: int, heads_kv: int) -> AttentionSpec:
        return AttentionSpec(self.head_dim, FP8, self.causal, heads_q, heads_kv)

    def _scheduled(self, spec: AttentionSpec) -> tvm.s_tir.Schedule:
        sch = tvm.s_tir.Schedule(schedule_registry.program_for(spec, self.schedule, self.knobs))
        return self.schedule.fp8_forward.apply(sch, **self.knobs)

    def source(self, heads_q: int = 1, heads_kv: int | None = None) -> str:
        """The generated CUDA source for these head counts."""
        return self.build.source(heads_q, heads_kv if heads_kv is not None else heads_q)

    def info(self) -> dict:
        """What this kernel is: its schedule, knobs, target and modules."""
        return {"schedule": self.schedule.name, "knobs": dict(self.knobs), "target": targets.describe(self.target),
                "modules": self.build.info()}

    def __repr__(self) -> str:
        return (f"tvmflash.kernels.fp8.Fp8Kernel(head_dim={self.head_dim}, causal={self.causal}, "
                f"target={targets.describe(self.target)!r})")

    def _usable(self, t: torch.Tensor) -> torch.Tensor:
        """t, or a compact copy where its strides do not suit the module (contiguous last dim, the others
        multiples of the schedule's alignment and not 0)."""
        if t.stride(-1) == 1 and all(s % self.stride_multiple == 0 and s > 0 for s in t.stride()[:-1]):
            return t
        return t.contiguous()

    def _descale(self, name: str, descale, batch: int, heads_kv: int, device) -> torch.Tensor:
        if descale is None:
            return torch.ones((batch, heads_kv), dtype=torch.float32, device=device)
        if not isinstance(descale, torch.Tensor) or descale.dtype != torch.float32:
            raise TypeError(f"{name}: expected a float32 tensor of shape ({batch}, {heads_kv}), got "
                            f"{getattr(descale, 'dtype', type(descale).__name__)}")
        if tuple(descale.shape) != (batch, heads_kv):
            raise ValueError(f"{name}: expected shape (batch, heads_kv) = ({batch}, {heads_kv}), got "
                             f"{tuple(descale.shape)}")
        if descale.device != device:
            raise ValueError(f"{name}: expected a tensor on {device}, got {descale.device}")
        return descale.contiguous()

    def __call__(self, q, k, v, q_descale=None, k_descale=None, v_descale=None, *, softmax_scale=None,
                 return_lse=False, out=None):
        """Attention of q over k, v in FP8. See the class docstring for the shapes. out: where to write the
        output (bf16, compact, q's shape), else a new tensor."""
        return_lse = check_flag("return_lse", return_lse)
        softmax_scale = resolve_softmax_scale(softmax_scale, self.head_dim)
        for name, t in (("q", q), ("k", k), ("v", v)):
            if not isinstance(t, torch.Tensor) or t.dtype != FP8_TORCH:
                raise TypeError(f"{name}: expected a torch.float8_e4m3fn tensor, got "
                                f"{getattr(t, 'dtype', type(t).__name__)}")
            if t.dim() != 4:
                raise ValueError(f"{name}: expected 4 dims (batch, seqlen, heads, head_dim), got {tuple(t.shape)}")
            if t.device != q.device:
                raise ValueError(f"{name}: expected a tensor on {q.device}, got {t.device}")
        batch, seqlen_q, heads_q, head_dim = q.shape
        _, seqlen_k, heads_kv, _ = k.shape
        if head_dim != self.head_dim:
            raise ValueError(f"q: expected head_dim {self.head_dim} (the kernel's), got {head_dim}")
        if tuple(k.shape) != (batch, seqlen_k, heads_kv, head_dim) or k.shape != v.shape:
            raise ValueError(f"k, v: expected (batch, seqlen_k, heads_kv, head_dim) = ({batch}, seqlen_k, heads_kv, "
                             f"{head_dim}), got {tuple(k.shape)} and {tuple(v.shape)}")
        if heads_kv < 1 or heads_q % heads_kv:
            raise ValueError(f"q's heads ({heads_q}) must be a multiple of k's and v's ({heads_kv})")
        if (q.device.type == "cuda") != targets.is_cuda(self.target):
            raise ValueError(f"q: expected a tensor for {targets.describe(self.target)}, got one on {q.device}")
        if torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v)):
            raise NotImplementedError("the FP8 forward has no backward: call it on tensors that require no grad, "
                                      "or under torch.no_grad()")
        descales = [self._descale(name, d, batch, heads_kv, q.device)
                    for name, d in (("q_descale", q_descale), ("k_descale", k_descale), ("v_descale", v_descale))]
        shape = (batch, seqlen_q, heads_q, head_dim)
        if out is None:
            out = torch.empty(shape, dtype=OUTPUT_TORCH, device=q.device)
        elif (not isinstance(out, torch.Tensor) or out.dtype != OUTPUT_TORCH or tuple(out.shape) != shape
              or not out.is_contiguous() or out.device != q.device):
            raise ValueError(f"out: expected a compact bf16 tensor of shape {shape} on {q.device}")
        lse = torch.empty((batch, heads_q, seqlen_q), dtype=torch.float32, device=q.device)
        if not out.numel():
            return (out, lse) if return_lse else out
        if not seqlen_k:  # no key: every row sees none
            out.zero_()
            lse.fill_(-math.inf)
            return (out, lse) if return_lse else out
        block_n = self.knobs["block_n"]
        keys = max(math.ceil(seqlen_k / block_n), self.min_kv_tiles) * block_n  # the tiles the program reads
        q, k = self._usable(q), self._usable(k)
        vt = transposed_v(v, keys)
        module = self.build.module_for(heads_q, heads_kv, q=q, k=k, v=vt, out=out)
        module.function(q, k, vt, out, lse, softmax_scale, *descales)
        return (out, lse) if return_lse else out


_KERNELS: dict[str, Fp8Kernel] = {}


def fp8_kernel(head_dim: int, causal: bool, target=None, schedule: str | None = None) -> Fp8Kernel:
    """The FP8 kernel for these, built once a process (its modules are cached on disk as every kernel's)."""
    resolved = targets.resolve(target)
    key = cache.digest([head_dim, causal, str(resolved), schedule])
    if key not in _KERNELS:
        _KERNELS[key] = Fp8Kernel(head_dim, causal, resolved, schedule)
    return _KERNELS[key]
