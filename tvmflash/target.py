"""Naming and detecting targets: what ``target=`` accepts, and which schedule serves it."""

from __future__ import annotations

import ctypes
import functools
import os
import sys
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


# LLVM's names of the AMX features the bf16 tile products need (schedules/amx), and Linux's.
AMX_FEATURES = ("amx-tile", "amx-bf16")
_AMX_CPUINFO_FLAGS = ("amx_tile", "amx_bf16")
# Linux: a process asks for the AMX tile data state (XFEATURE_XTILEDATA) before its first AMX
# instruction, else that instruction raises SIGILL.
_SYS_ARCH_PRCTL, _ARCH_GET_XCOMP_PERM, _ARCH_REQ_XCOMP_PERM, _XFEATURE_XTILEDATA = 158, 0x1022, 0x1023, 18


def cpu_target() -> tvm.target.Target:
    """The host CPU, with its real micro-architecture so LLVM uses every vector unit.

    Its AMX features are the host's own: LLVM's ``mcpu`` names a micro-architecture, and a CPU of that
    name may lack AMX where a hypervisor hides it or Linux does not grant it (``host_amx``), so they are
    turned off there, and on where the host has them and the ``mcpu`` does not say so. Elsewhere
    the target is the plain ``mcpu``'s."""
    from tvm.target import codegen

    plain = {"kind": "llvm", "mcpu": codegen.llvm_get_system_cpu(), "num-cores": os.cpu_count() or 1}
    implied = llvm_has_features(tvm.target.Target(plain), AMX_FEATURES)
    if implied == host_amx():
        return tvm.target.Target(plain)
    sign = "+" if host_amx() else "-"
    return tvm.target.Target({**plain, "mattr": [sign + feature for feature in AMX_FEATURES]})


def llvm_has_features(target: tvm.target.Target, features) -> bool:
    """Whether an llvm target's CPU (its ``mcpu`` and ``mattr``) has these LLVM features."""
    from tvm.target import codegen

    return target.kind.name == "llvm" and codegen.llvm_cpu_has_features(list(features), target)


@functools.lru_cache(maxsize=1)
def host_amx() -> bool:
    """Whether this process may run AMX bf16 instructions: the CPU has them (Linux's cpuinfo flags)
    and Linux grants the process the tile data state (``enable_amx``)."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            flags = next((line.split(":", 1)[1].split() for line in cpuinfo if line.startswith("flags")), [])
    except OSError:
        return False
    return all(flag in flags for flag in _AMX_CPUINFO_FLAGS) and enable_amx()


@functools.lru_cache(maxsize=1)
def enable_amx() -> bool:
    """Ask Linux once for this process's AMX tile data state (arch_prctl ARCH_REQ_XCOMP_PERM; torch's
    oneDNN may have asked already, which the first query sees). True if granted."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        granted = ctypes.c_uint64(0)
        if libc.syscall(_SYS_ARCH_PRCTL, _ARCH_GET_XCOMP_PERM, ctypes.byref(granted)) == 0 and \
                granted.value & (1 << _XFEATURE_XTILEDATA):
            return True
        return libc.syscall(_SYS_ARCH_PRCTL, _ARCH_REQ_XCOMP_PERM, _XFEATURE_XTILEDATA) == 0
    except (OSError, AttributeError):
        return False


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


def converts_fp8(target: tvm.target.Target) -> bool:
    """Does the target convert FP8 values itself (cvt on sm_89 and newer)? Elsewhere TVM's FP8ComputeLegalize
    converts e4m3 by a bit expression that has no zero, subnormal or NaN (byte 0 becomes 2^-7): the CPU's LLVM
    code and sm_80/sm_86's CUDA alike (``program_e4m3.e4m3_bits_to_float32`` converts there instead). TVM's
    own rule (``tvm.support.nvcc.supports_fp8``): compute capability 8.9, or 9 and newer."""
    capability = compute_capability(target)
    return capability is not None and (capability == 89 or capability >= 90)


def describe(target: tvm.target.Target) -> str:
    if is_cuda(target):
        return f"cuda {target.attrs['arch']}"
    return f"llvm {target.attrs.get('mcpu', '')}".strip()
