"""Targets: what ``target=`` accepts, and that a GPU newer than the schedules know gets a build of its own
arch (sm_90a's wgmma does not exist past sm90: such a card would fail to load that build)."""

import pytest
import torch

import tvmflash
from tvmflash import target as targets


@pytest.mark.parametrize("capability, arch, shared", [
    ((10, 0), "sm_100", 232448), ((10, 3), "sm_103", 232448), ((12, 0), "sm_120", 101376),
    ((12, 1), "sm_121", 101376), ((9, 0), "sm_90a", 232448), ((8, 7), "sm_87", 101376), ((7, 5), "sm_75", None),
])
def test_each_gpu_gets_its_own_arch(monkeypatch, capability, arch, shared):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index=None: capability)
    target = targets.cuda_device_target()
    assert str(target.attrs["arch"]) == arch
    assert (int(target.attrs["max_shared_memory_per_block"]) if "max_shared_memory_per_block" in target.attrs
            else None) == shared


@pytest.mark.parametrize("arch", ["sm100", "sm120"])
def test_a_newer_gpu_runs_the_sm80_schedule_built_for_its_own_arch(arch):
    kernel = tvmflash.compile(head_dim=64, dtype="bfloat16", causal=True, target=arch)
    source = kernel.source(heads_q=4, heads_kv=2)
    info = kernel.info()
    assert info["schedule"] == "sm80" and info["target"] == f"cuda sm_{arch[2:]}"
    assert "mma.sync" in source and "wgmma" not in source
