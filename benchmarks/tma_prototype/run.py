"""TMA prototype, part 2 (an sm_90a GPU, CuPy): load the cubins of build.py, check them against
SDPA's flash backend and time them with CUDA events (median of 30 after 3 warm-ups), next to
SDPA flash and cuDNN timed in the same run (tvmflash's timer: tvmflash and TVM must import). The tensor maps (for K and V) are made here with
libcuda's cuTensorMapEncodeTiled and put in global memory; the kernels take their addresses.

    python benchmarks/tma_prototype/run.py OUT_DIR
"""
import ctypes
import json
import os
import sys

import cupy
import numpy as np
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from tvmflash.bench import time_ms

BFLOAT16, SWIZZLE_128B, L2_PROMOTION_128B = 9, 3, 2  # CUtensorMapDataType, CUtensorMapSwizzle, ...L2promotion
libcuda = ctypes.CDLL("libcuda.so.1")
CUDA = torch.device("cuda")


def tensor_map(t: torch.Tensor, rows: int = 64) -> bytes:
    """A (batch, seqlen, heads, head_dim) bf16 tensor as the 5-D view (64 elements, row, 64-column
    half, head, batch), box (64, rows, head_dim / 64, 1, 1), 128-byte swizzle."""
    batch, seqlen, heads, head_dim = t.shape
    raw = ctypes.create_string_buffer(128 + 64)
    address = (ctypes.addressof(raw) + 63) // 64 * 64  # a tensor map is 64-byte aligned
    u64, u32 = ctypes.c_uint64 * 5, ctypes.c_uint32 * 5
    dims = u64(64, seqlen, head_dim // 64, heads, batch)
    strides = (ctypes.c_uint64 * 4)(heads * head_dim * 2, 128, head_dim * 2, seqlen * heads * head_dim * 2)
    result = libcuda.cuTensorMapEncodeTiled(ctypes.c_void_p(address), BFLOAT16, 5, ctypes.c_void_p(t.data_ptr()), dims,
                                            strides, u32(64, rows, head_dim // 64, 1, 1), u32(1, 1, 1, 1, 1), 0,
                                            SWIZZLE_128B, L2_PROMOTION_128B, 0)
    assert result == 0, f"cuTensorMapEncodeTiled: CUresult {result}"
    return bytes((ctypes.c_uint8 * 128).from_address(address))


def main(out):
    spec = json.load(open(os.path.join(out, "kernels.json")))
    D, H = spec["head_dim"], spec["heads"]
    torch.manual_seed(0)
    stream = cupy.cuda.ExternalStream(torch.cuda.current_stream().cuda_stream)
    for causal in (False, True):
        for B, S in ((16, 1024), (4, 4000), (4, 4096), (2, 8192)):
            q, k, v = (torch.randn(B, S, H, D, device="cuda", dtype=torch.bfloat16) for _ in range(3))
            qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))
            sdpa = {}
            for backend in (SDPBackend.FLASH_ATTENTION, SDPBackend.CUDNN_ATTENTION):
                with sdpa_kernel([backend]):
                    call = lambda: torch.nn.functional.scaled_dot_product_attention(qt, kt, vt, is_causal=causal)
                    out_ref = call()
                    sdpa[backend] = time_ms(call, CUDA, repeat=30)
            ref = out_ref.transpose(1, 2).float()
            flops = 4 * B * H * S * S * D // (2 if causal else 1)
            maps = torch.tensor(list(tensor_map(k) + tensor_map(v)), dtype=torch.uint8, device="cuda")
            blocks = -(-S // 128)
            grid = (H, blocks, B) if causal else (blocks, H, B)
            flash, cudnn = (flops / sdpa[b] / 1e9 for b in (SDPBackend.FLASH_ATTENTION, SDPBackend.CUDNN_ATTENTION))
            line = f"causal={int(causal)} b{B} s{S}: SDPA flash {flash:.1f}, cuDNN {cudnn:.1f} TFLOP/s |"
            for name, kern in spec["kernels"].items():
                if kern["causal"] != causal:
                    continue
                o = torch.full_like(q, float("nan"))
                lse = torch.empty(B, H, S, device="cuda", dtype=torch.float32)
                f = cupy.RawModule(path=os.path.join(out, name + ".cubin")).get_function("main_kernel")
                f.max_dynamic_shared_size_bytes = kern["shared_bytes"]
                args = tuple(np.uint64(t.data_ptr()) for t in (k, lse, o, q, v)) + (
                    np.int32(B), np.int32(S), np.int32(S), np.float32(D ** -0.5))
                if kern["tma"]:
                    args += (np.uint64(maps.data_ptr()), np.uint64(maps.data_ptr() + 128))
                run = lambda: f(grid, (128, 2, 1), args, shared_mem=kern["shared_bytes"], stream=stream)
                run()
                torch.cuda.synchronize()
                err = ((o.float() - ref).norm() / ref.norm()).item()
                tflops = flops / time_ms(run, CUDA, repeat=30) / 1e9
                line += f" {name} {tflops:.1f} ({tflops / flash:.2f}x flash, {tflops / cudnn:.2f}x cuDNN, rel. err {err:.1e})"
            print(line, flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
