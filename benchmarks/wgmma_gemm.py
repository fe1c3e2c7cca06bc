"""Device check (H100/H200, sm_90a): a standalone GEMM on the sm90 schedule's wgmma intrinsics.

Builds C = A @ B^T (B K-major: the QK^T path) and C = A @ B (B N-major: the PV path) with the
same helpers and tensor intrinsics as schedules/sm90.py (core-matrix shared layout, matrix
descriptors, per-thread accumulator layout), runs them on torch CUDA tensors and compares with
torch.matmul in float32. Prints one PASS/FAIL line per case with the max error, and for a
failure a diagnosis: where in the reference each wrong output element's value really is (that
tells a wrong fragment layout or descriptor from wrong numbers).

    PYTHONPATH=$PWD python benchmarks/wgmma_gemm.py          # exit status 1 if any case fails
    PYTHONPATH=$PWD python benchmarks/wgmma_gemm.py --source # print one generated kernel too
"""

from __future__ import annotations

import sys
import time

import torch
import tvm
from tvm.script import tirx as T

from tvmflash.schedules import sm90
from tvmflash.target import cuda_target

TORCH = {"float16": torch.float16, "bfloat16": torch.bfloat16}


def gemm_func(M, N, K, dtype, b_major):
    """C[M, N] (float32) = A[M, K] @ (B[N, K]^T if b_major == "k" else B[K, N])."""
    b_shape = (N, K) if b_major == "k" else (K, N)

    def b_at(j, k):  # B's element for output column j, reduction index k
        return (j, k) if b_major == "k" else (k, j)

    @T.prim_func(s_tir=True)
    def main(A: T.Buffer((M, K), dtype), B: T.Buffer(b_shape, dtype), C: T.Buffer((M, N), "float32")):
        T.func_attr({"global_symbol": "main", "tirx.noalias": True})
        for i, j, k in T.grid(M, N, K):
            with T.sblock("C"):
                vi, vj, vk = T.axis.remap("SSR", [i, j, k])
                bj, bk = T.meta_var(b_at(vj, vk))
                with T.init():
                    C[vi, vj] = T.float32(0)
                C[vi, vj] = C[vi, vj] + T.cast(A[vi, vk], "float32") * T.cast(B[bj, bk], "float32")
    return main


def schedule_gemm(M, N, K, dtype, b_major, num_warpgroups=2):
    sch = tvm.s_tir.Schedule(gemm_func(M, N, K, dtype, b_major))
    intrin = sm90.wgmma_intrin_name(N, K, dtype, b_major)
    block = sch.get_sblock("C")
    i, _, _ = sch.get_loops(block)
    bx, _ = sch.split(i, [None, sm90.WG_ROWS * num_warpgroups])
    sch.bind(bx, "blockIdx.x")
    for index in (0, 1):
        copy = sch.cache_read(block, index, "shared.dyn")
        sch.compute_at(copy, bx)
        sch.transform_layout(copy, ("write", 0), sm90._core_matrix_map)
        sm90._copy_along_rows(sch, copy, num_warpgroups, 8)
    acc = sch.cache_write(block, 0, "local")
    sch.reverse_compute_at(acc, bx)
    sch.transform_layout(block, ("write", 0), sm90._acc_index_map)
    rows = sm90._warpgroup_gemm(sch, block, num_warpgroups)
    sm90._acc_block(sch, acc, num_warpgroups)
    sch.tensorize(rows, intrin)
    return sch


def diagnose(got, ref, tol, limit=8):
    """For wrong elements, where the reference holds the value we got (first hits)."""
    bad = ((got - ref).abs() > tol).nonzero().tolist()
    flat = ref.flatten()
    lines = [f"    {len(bad)} of {ref.numel()} elements wrong"]
    for i, j in bad[:limit]:
        hits = ((flat - got[i, j]).abs() <= tol).nonzero().flatten().tolist()[:3]
        where = [divmod(h, ref.shape[1]) for h in hits]
        lines.append(f"    C[{i},{j}] = {got[i, j].item():.4f}, ref {ref[i, j].item():.4f}; "
                     f"that value is at ref{where}")
    return "\n".join(lines)


def run_case(M, N, K, dtype, b_major, show_source=False):
    target = cuda_target("sm90")
    start = time.perf_counter()
    sch = schedule_gemm(M, N, K, dtype, b_major)
    with tvm.transform.PassContext(opt_level=3):
        ex = tvm.compile(sch.mod, target=target)
    if show_source:
        print(ex.mod.imports[0].inspect_source())
    build_s = time.perf_counter() - start
    gen = torch.Generator(device="cuda").manual_seed(0)
    a = torch.randn(M, K, device="cuda", generator=gen).to(TORCH[dtype])
    b_shape = (N, K) if b_major == "k" else (K, N)
    b = torch.randn(*b_shape, device="cuda", generator=gen).to(TORCH[dtype])
    c = torch.full((M, N), float("nan"), device="cuda")
    ex["main"](a, b, c)
    torch.cuda.synchronize()
    bt = b.float().T if b_major == "k" else b.float()
    ref = a.float() @ bt
    err = (c - ref).abs().max().item()
    ok = err <= 1e-3 * max(1.0, ref.abs().max().item())  # fp32 accumulation of exact products
    name = f"M{M} N{N} K{K} {dtype} B {b_major}-major"
    print(f"{'PASS' if ok else 'FAIL'} {name}: max abs error {err:.3e} (build {build_s:.1f} s)", flush=True)
    if not ok:
        print(diagnose(c, ref, 1e-3 * max(1.0, ref.abs().max().item())), flush=True)
    return ok


def main():
    show = "--source" in sys.argv
    cases = [
        (256, 64, 128, "bfloat16", "k"),   # QK^T: block_n 64, head_dim 128
        (256, 128, 64, "bfloat16", "k"),
        (256, 128, 64, "bfloat16", "mn"),  # PV: head_dim 128, block_n 64
        (256, 64, 128, "bfloat16", "mn"),
        (256, 64, 128, "float16", "k"),
        (256, 128, 64, "float16", "mn"),
        (128, 256, 64, "bfloat16", "mn"),  # head_dim 256 on PV
    ]
    results = []
    for index, case in enumerate(cases):
        try:
            results.append(run_case(*case, show_source=show and index == 0))
        except Exception as err:  # noqa: BLE001 - report and go on
            print(f"FAIL {case}: {type(err).__name__}: {str(err)[-2000:]}", flush=True)
            results.append(False)
    print(f"{sum(results)}/{len(results)} passed")
    sys.exit(0 if all(results) else 1)


if __name__ == "__main__":
    main()
