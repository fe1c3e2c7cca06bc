"""One rank of tests/test_distributed.py: ``python tests/distributed_worker.py RANK WORLD PORT OUT BACKEND
CASE...`` joins a process group of WORLD processes on 127.0.0.1:PORT (BACKEND gloo: float32 on the CPU;
nccl: bfloat16 on GPU RANK), runs each named case of ``CASES`` (ring or
Ulysses attention of one sequence over the ranks, forward and gradients, or a call that must fail), and
writes {case: result} as JSON to OUT: this rank's errors against float64 attention of the whole sequence
(tests/reference.py) and torch's float32 errors on the same rows, or the error a failing call raised."""

import json
import os
import sys
import traceback
import zlib

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from reference import max_error, reference  # noqa: E402

import tvmflash.distributed as cp  # noqa: E402

# name -> the call: "function" (ring or ulysses), "heads" (q, kv; default 4, 2), "batch" (default 1),
# "documents" (their lengths: varlen), "lse" (the loss takes lse too), "compile" (inside torch.compile),
# "alibi", "subgroups" (the ranks in groups of two, each group its own sequence), and the function's
# keywords. The whole sequence: SEQLEN tokens of HEAD_DIM.
CASES = {
    "ring-contiguous": dict(function="ring", causal=False),
    "ring-contiguous-causal": dict(function="ring", causal=True),
    "ring-zigzag-causal": dict(function="ring", causal=True, layout="zigzag", batch=2),
    "ring-zigzag": dict(function="ring", causal=False, layout="zigzag"),
    "ring-causal-lse": dict(function="ring", causal=True, lse=True),
    "ring-causal-window-softcap": dict(function="ring", causal=True, window_size=(40, -1), softcap=5.0),
    "ring-zigzag-causal-window": dict(function="ring", causal=True, layout="zigzag", window_size=(24, -1)),
    "ring-window-both-sides": dict(function="ring", causal=False, window_size=(20, 12)),
    "ring-zigzag-window-both-sides": dict(function="ring", causal=False, layout="zigzag", window_size=(20, 12)),
    "ring-varlen-causal": dict(function="ring", causal=True, documents=(10, 37, 1, 0, 50, 30)),
    "ring-varlen-zigzag-causal": dict(function="ring", causal=True, layout="zigzag", documents=(10, 37, 1, 0, 50, 30)),
    "ring-varlen-zigzag-softcap": dict(function="ring", causal=False, layout="zigzag", softcap=4.0,
                                       documents=(70, 3, 55)),
    "ring-compiled-deterministic": dict(function="ring", causal=True, layout="zigzag", deterministic=True,
                                        compile=True),
    "ring-subgroups": dict(function="ring", causal=True, layout="zigzag", subgroups=True),
    # local heads 4/1 (at W=2 MQA's one K/V head repeated twice): the modules of each other and of
    # test_backward's CPU gradients (d32 float32 MQA 4/1), built once in the suite
    "ulysses-subgroups": dict(function="ulysses", causal=True, subgroups=True, heads=(8, 2)),
    "ulysses-causal": dict(function="ulysses", causal=True, batch=2, heads=(16, 4)),
    "ulysses-zigzag-lse-mqa": dict(function="ulysses", causal=True, layout="zigzag", heads=(8, 1), lse=True),
    "ulysses-alibi-window": dict(function="ulysses", causal=False, window_size=(16, 8), alibi=True),
}
SEQLEN, HEAD_DIM = 128, 32


def varlen_reference(q, k, v, documents, causal, dtype, **variant):
    """``reference`` of each document of the packed q (total, heads, d), k, v on its own: (out (total,
    heads, d), lse (heads, total))."""
    outs, lses, start = [], [], 0
    for n in documents:
        rows = slice(start, start + n)
        out, lse = reference(q[None, rows], k[None, rows], v[None, rows], causal=causal, dtype=dtype, **variant)
        outs.append(out[0])
        lses.append(lse[0])
        start += n
    return torch.cat(outs), torch.cat(lses, 1)


def run_case(rank, world, name, case, device, dtype):
    case = dict(case)
    documents = case.pop("documents", None)
    compiled = case.pop("compile", False)
    batch = case.pop("batch", 1)
    seed = zlib.crc32(name.encode())
    if case.pop("subgroups", False):  # every rank makes every group (new_group's rule); this rank uses its own
        groups = [dist.new_group([r, r + 1]) for r in range(0, world, 2)]
        case["group"] = groups[rank // 2]
        seed += rank // 2  # each group its own sequence
        rank, world = dist.get_rank(case["group"]), 2
    function = {"ring": cp.ring_attention, "ulysses": cp.ulysses_attention}[case.pop("function")]
    heads_q, heads_kv = case.pop("heads", (4, 2))
    with_lse = case.pop("lse", False)
    alibi = case.pop("alibi", False)
    causal = case.pop("causal")
    layout = case.get("layout", "contiguous")
    gen = torch.Generator().manual_seed(seed)  # the same sequence on every rank (of the group)
    q = torch.randn(batch, SEQLEN, heads_q, HEAD_DIM, generator=gen)
    k = torch.randn(batch, SEQLEN, heads_kv, HEAD_DIM, generator=gen)
    v = torch.randn(batch, SEQLEN, heads_kv, HEAD_DIM, generator=gen)
    dout = torch.randn(batch, SEQLEN, heads_q, HEAD_DIM, generator=gen)
    dlse = torch.randn(batch, heads_q, SEQLEN, generator=gen) if with_lse else None
    slopes = torch.rand(heads_q, generator=gen).to(device) * 0.3 if alibi else None
    q, k, v, dout = (t.to(device, dtype) for t in (q, k, v, dout))
    dlse = None if dlse is None else dlse.to(device)
    seq_dim = 1
    if documents is not None:  # flash-attn's varlen layout: (total, heads, d), lse (heads, total)
        q, k, v, dout = (t[0] for t in (q, k, v, dout))
        dlse = None if dlse is None else dlse[0]
        seq_dim = 0
        offsets = [0]
        for n in documents:
            offsets.append(offsets[-1] + n)
        case["cu_seqlens"] = torch.tensor(offsets, dtype=torch.int32, device=device)
    variant = dict(window_size=case.get("window_size", (-1, -1)), softcap=case.get("softcap", 0.0),
                   alibi_slopes=slopes)

    def mine(x, dim=seq_dim):
        return cp.shard(x, rank, world, dim, layout)

    shards = [mine(t).requires_grad_() for t in (q, k, v)]
    if compiled:  # inside a compiled function: a graph break around the call, which runs eagerly
        eager = function

        def function(*args, **kwargs):
            return tuple(t * 1.0 for t in eager(*args, **kwargs))

        function = torch.compile(function, backend="eager")
    result = function(*shards, causal=causal, return_lse=True, alibi_slopes=slopes, **case)
    out, lse = result
    loss = (out * mine(dout)).sum()
    if with_lse:
        loss = loss + (lse * mine(dlse, seq_dim + 1)).sum()
    loss.backward()

    errors = {}
    for ref_dtype, key in ((torch.float64, "ref"), (dtype, "torch")):  # float64, and torch's in the inputs' dtype
        leaves = [t.detach().clone().to(ref_dtype).requires_grad_() for t in (q, k, v)]
        if documents is None:
            ref_out, ref_lse = reference(*leaves, causal=causal, dtype=ref_dtype, **variant)
        else:
            ref_out, ref_lse = varlen_reference(*leaves, documents, causal, ref_dtype, **variant)
        ref_loss = (ref_out * dout.to(ref_dtype)).sum() + ((ref_lse * dlse.to(ref_dtype)).sum() if with_lse else 0)
        grads = torch.autograd.grad(ref_loss, leaves)
        errors[key] = {"out": mine(ref_out.detach()), "lse": mine(ref_lse.detach(), seq_dim + 1),
                       **{n: mine(g) for n, g in zip(("dq", "dk", "dv"), grads)}}
    ours = {"out": out.detach(), "lse": lse.detach(), **{n: t.grad for n, t in zip(("dq", "dk", "dv"), shards)}}
    return {n: {"ours": max_error(ours[n], errors["ref"][n]), "torch": max_error(errors["torch"][n], errors["ref"][n]),
                "scale": errors["ref"][n].abs().max().item(), "finite": bool(torch.isfinite(ours[n]).all())}
            for n in ours}


def run_failure(rank, world, name):
    """A call that must raise on every rank: its exception's type and message."""
    q = torch.randn(1, 16, 4, 32)
    try:
        if name == "shard-lengths-differ":
            n = 16 if rank == 0 else 8
            cp.ring_attention(torch.randn(1, n, 4, 32), torch.randn(1, n, 2, 32), torch.randn(1, n, 2, 32))
        elif name == "zigzag-odd-shard":
            x = torch.randn(1, 15, 4, 32)
            cp.ring_attention(x, x, x, layout="zigzag")
        elif name == "ulysses-heads":
            x = torch.randn(1, 16, world + 1, 32)
            cp.ulysses_attention(x, x, x)
        elif name == "ring-alibi":
            cp.ring_attention(q, q, q, alibi_slopes=torch.ones(4))
        elif name == "ring-varlen-window":
            x = torch.randn(16, 4, 32)
            cp.ring_attention(x, x, x, cu_seqlens=torch.tensor([0, 16 * world], dtype=torch.int32),
                              window_size=(4, -1))
        else:
            raise KeyError(name)
    except Exception as e:  # noqa: BLE001 - reported to the test, which checks the type
        return {"raised": type(e).__name__, "message": str(e)}
    return {"raised": None}


FAILURES = ("shard-lengths-differ", "zigzag-odd-shard", "ulysses-heads", "ring-alibi", "ring-varlen-window")


def main():
    rank, world, port, out_path, backend, *names = sys.argv[1:]
    rank, world = int(rank), int(world)
    torch.set_num_threads(1)
    if backend == "nccl":
        torch.cuda.set_device(rank)
        device, dtype = torch.device("cuda", rank), torch.bfloat16
    else:
        device, dtype = torch.device("cpu"), torch.float32
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    results = {}
    for name in names:
        try:
            if name in FAILURES:
                results[name] = run_failure(rank, world, name)
            else:
                results[name] = run_case(rank, world, name, CASES[name], device, dtype)
        except Exception:  # noqa: BLE001 - the test shows it
            results[name] = {"error": traceback.format_exc()}
        dist.barrier()
    with open(out_path, "w") as f:
        json.dump(results, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
