"""One launch each of tvmflash's default kernel and cuDNN's (SDPA), non-causal then causal, for Nsight
Compute to profile side by side (H200, 2026-12-01, commit 0e948a5). On an sm_90a GPU:

    ncu --clock-control none -k regex:'main_kernel|cudnn' --section LaunchStats --section Occupancy \\
        --section SpeedOfLight --section ComputeWorkloadAnalysis --section WarpStateStats \\
        --print-details all python benchmarks/profile_vs_cudnn.py [HEAD_DIM [SEQLEN]]   # 128, 4096

Shapes: bf16, seqlen SEQLEN, batch 16384 / SEQLEN, heads 2048 / HEAD_DIM."""
import sys

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

import tvmflash

D = int(sys.argv[1]) if len(sys.argv) > 1 else 128
S = int(sys.argv[2]) if len(sys.argv) > 2 else 4096
B, H = max(1, 16384 // S), 2048 // D
q, k, v = (torch.randn(B, S, H, D, device="cuda", dtype=torch.bfloat16) for _ in range(3))
for causal in (False, True):
    kernel = tvmflash.compile(head_dim=D, dtype="bfloat16", causal=causal, heads_q=H, heads_kv=H)
    kernel(q, k, v)
    torch.cuda.synchronize()
    with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
        torch.nn.functional.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                                         is_causal=causal)
    torch.cuda.synchronize()
