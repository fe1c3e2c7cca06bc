"""Naming and detecting targets: what ``target=`` accepts, and which schedule serves it."""

from __future__ import annotations

import os
from typing import Any

import tvm

# Per-block limits the CUDA tag database gets wrong or leaves out (sm80: 163 KiB opt-in shared
# memory; sm90 and sm100: 227 KiB; sm120: 99 KiB).
_CUDA_ARCHS = {
    "sm80": {"arch": "sm_80", "max_shared_memory_per_block": 166912},
    "sm86": {"arch": "sm_86", "max_shared_memory_per_block": 101376},
    "sm89": {"arch": "sm_89", "max_shared_memory_per_block": 101376},
    "sm90": {"arch": "sm_90a", "max_shared_memory_per_block": 232448},
    "sm100": {"arch": "sm_100", "max_shared_memory_per_block": 232448},
    "sm120": {"arch": "sm_120", "max_shared_memory_per_block": 101376},
}


def cpu_target() -> tvm.target.Target:
    """The host CPU, with its real micro-architecture so LLVM uses every vector unit."""
    from tvm.target import codegen

    return tvm.target.Target(
        {"kind": "llvm", "mcpu": codegen.llvm_get_system_cpu(), "num-cores": os.cpu_count() or 1}
    )


def cuda_target(name: str) -> tvm.target.Target:
    """``name`` is one of ``_CUDA_ARCHS``: "sm80", "sm86", "sm89", "sm90", "sm100", "sm120"."""
    limits = _CUDA_ARCHS[name]
    return tvm.target.Target(
        {"kind": "cuda", "max_threads_per_block": 1024, "thread_warp_size": 32, **limits}
    )


def cuda_device_target(device_index: int | None = None) -> tvm.target.Target | None:
    """The target for a torch CUDA device (default: the current one), or None without a GPU.

    Known architectures get their tuned limits. Others run under their own arch: a newer one with the
    limits of the known architecture of its family (sm_90a's wgmma does not exist past sm90, so no
    newer GPU may take that build), an older one with none (the portable SIMT schedule serves it).
    """
    try:
        import torch
    except ImportError:  # pragma: no cover - torch is a dependency
        return None
    if not torch.cuda.is_available():
        return None
    major, minor = torch.cuda.get_device_capability(device_index)
    name = f"sm{major}{minor}"
    if name in _CUDA_ARCHS:
        return cuda_target(name)
    family = next((known for known in sorted(_CUDA_ARCHS, key=lambda n: int(n[2:]), reverse=True)
                   if int(known[2:]) // 10 <= major), None) if major >= 8 else None
    limits = {"max_shared_memory_per_block": _CUDA_ARCHS[family]["max_shared_memory_per_block"]} if family else {}
    return tvm.target.Target({"kind": "cuda", "arch": f"sm_{major}{minor}", "max_threads_per_block": 1024,
                              "thread_warp_size": 32, **limits})


def resolve(target: Any = None) -> tvm.target.Target:
    """Turn what the user passed as ``target=`` into a TVM target.

    None means the current torch CUDA device if there is one, else the CPU. Strings: "cpu",
    "cuda" (the current GPU), "sm80", "sm86", "sm89", "sm90", "sm100", "sm120". A ``tvm.target.Target`` or a JSON
    dict is used as it is.
    """
    if isinstance(target, tvm.target.Target):
        return target
    if isinstance(target, dict):
        return tvm.target.Target(target)
    if target is None or target == "cuda":
        gpu = cuda_device_target()
        if gpu is not None:
            return gpu
        if target == "cuda":
            raise ValueError("target: 'cuda' needs a CUDA GPU visible to torch, and none is")
        return cpu_target()
    if target in ("cpu", "llvm"):
        return cpu_target()
    if isinstance(target, str) and target in _CUDA_ARCHS:
        return cuda_target(target)
    raise ValueError(
        f"target: expected None, 'cpu', 'cuda', one of {sorted(_CUDA_ARCHS)}, a tvm.target.Target or a "
        f"JSON dict, got {target!r}"
    )


def is_cuda(target: tvm.target.Target) -> bool:
    return target.kind.name == "cuda"


def compute_capability(target: tvm.target.Target) -> int | None:
    """80 for sm_80, 90 for sm_90a; None for the CPU."""
    if not is_cuda(target):
        return None
    arch = str(target.attrs.get("arch", "sm_50"))
    return int("".join(ch for ch in arch.split("_")[1] if ch.isdigit()))


def describe(target: tvm.target.Target) -> str:
    if is_cuda(target):
        return f"cuda {target.attrs['arch']}"
    return f"llvm {target.attrs.get('mcpu', '')}".strip()
