"""tvmflash.distributed: ring and Ulysses attention over processes of a gloo group on the CPU (2 and 4
ranks, spawned here), forward and gradients of each rank's shard against float64 attention of the whole
sequence, by flash-attn's rule; NCCL on GPUs where there are two or more (``gpu``). The ranks run
tests/distributed_worker.py, all of one world's cases in one launch, and share the run's kernel cache, so
each kernel builds once. The step plan and the layouts are checked here without processes."""

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tvmflash.distributed import plan
from tvmflash.distributed.layout import segments, shard, unshard, zigzag_order, zigzag_shard, zigzag_unshard
from tvmflash.distributed.ulysses import zigzag_index

WORKER = Path(__file__).resolve().parent / "distributed_worker.py"
ROOT = WORKER.parent.parent

# the cases of each world (names of distributed_worker.CASES and FAILURES)
CPU_CASES = {
    2: ["ring-contiguous-causal", "ring-zigzag-causal", "ring-causal-lse", "ring-causal-window-softcap",
        "ring-zigzag-window-both-sides",
        "ring-varlen-causal", "ring-varlen-zigzag-causal", "ring-varlen-zigzag-softcap",
        "ring-compiled-deterministic", "ulysses-zigzag-lse-mqa", "ulysses-alibi-window",
        "shard-lengths-differ", "zigzag-odd-shard", "ulysses-heads", "ring-alibi", "ring-varlen-window"],
    4: ["ring-zigzag-causal", "ring-contiguous", "ring-varlen-zigzag-causal", "ulysses-causal", "ring-subgroups",
        "ulysses-subgroups"],
}
GPU_CASES = ["ring-contiguous-causal", "ring-zigzag-causal", "ring-zigzag", "ring-causal-lse",
             "ring-causal-window-softcap", "ring-zigzag-causal-window", "ring-zigzag-window-both-sides",
             "ring-varlen-zigzag-causal", "ulysses-zigzag-lse-mqa", "ulysses-alibi-window"]
RAISES = {"shard-lengths-differ": ("ValueError", "same shape of q on every rank"),
          "zigzag-odd-shard": ("ValueError", "even shard_len"),
          "ulysses-heads": ("ValueError", "multiple of the world size"),
          "ring-alibi": ("NotImplementedError", "alibi_slopes"),
          "ring-varlen-window": ("NotImplementedError", "window_size")}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(world: int, backend: str, cases, tmp_path, timeout=600) -> list[dict]:
    """Run the worker on ``world`` ranks; each rank's {case: result}."""
    port = free_port()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
           "OMP_NUM_THREADS": "1"}
    outs = [tmp_path / f"rank{r}.json" for r in range(world)]
    procs = [subprocess.Popen([sys.executable, str(WORKER), str(r), str(world), str(port), str(outs[r]), backend,
                               *cases], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for r in range(world)]
    logs = []
    try:
        for p in procs:
            logs.append(p.communicate(timeout=timeout)[0])
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    for r, (p, log) in enumerate(zip(procs, logs)):
        assert p.returncode == 0, f"rank {r} exited with {p.returncode}:\n{log[-4000:]}"
    return [json.loads(out.read_text()) for out in outs]


def check_results(results, name, eps=1e-5):
    """flash-attn's rule on every rank: our error against float64 at most 2x torch's in the same dtype,
    plus eps · (1 + the largest element); or the expected exception on every rank."""
    for rank, result in enumerate(results):
        got = result[name]
        assert "error" not in got, f"rank {rank}: {got.get('error')}"
        if name in RAISES:
            kind, words = RAISES[name]
            assert got["raised"] == kind and words in got["message"], f"rank {rank}: {got}"
            continue
        for tensor, e in got.items():
            assert e["finite"], f"rank {rank}: {tensor} has NaN/inf"
            bound = 2 * e["torch"] + eps * (1 + e["scale"])
            assert e["ours"] <= bound, (f"rank {rank}: {tensor} error {e['ours']:.3e} > {bound:.3e} "
                                        f"(torch's {e['torch']:.3e})")


@pytest.fixture(scope="module", params=sorted(CPU_CASES))
def gloo_results(request, tmp_path_factory):
    world = request.param
    return world, launch(world, "gloo", CPU_CASES[world], tmp_path_factory.mktemp(f"gloo{world}"))


def test_gloo(gloo_results):
    """Every case of the world, each checked on every rank (one launch a world: the processes start once)."""
    world, results = gloo_results
    failures = []
    for name in CPU_CASES[world]:
        try:
            check_results(results, name)
        except AssertionError as e:
            failures.append(f"{name} (world {world}): {e}")
    assert not failures, "\n".join(failures)


@pytest.mark.gpu
def test_nccl_on_two_gpus(tmp_path):
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two CUDA GPUs")
    results = launch(2, "nccl", GPU_CASES, tmp_path)
    failures = []
    for name in GPU_CASES:
        try:
            check_results(results, name)
        except AssertionError as e:
            failures.append(f"{name}: {e}")
    assert not failures, "\n".join(failures)


# ----------------------------------------------------------------------------- without processes
def _positions(runs):
    return {local + i - start: i for start, end, local in runs for i in range(start, end)}


def _kernel_mask(p: plan.Piece):
    """The (local query, local key) pairs a kernel call of ``p`` lets through (bottom-right alignment)."""
    sq, sk = p.q1 - p.q0, p.k1 - p.k0
    left, right = p.window[0], 0 if p.causal else p.window[1]
    return {(p.q0 + a, p.k0 + b) for a in range(sq) for b in range(sk)
            if (right < 0 or b <= a + sk - sq + right) and (left < 0 or b >= a + sk - sq - left)}


@pytest.mark.parametrize("layout", ["contiguous", "zigzag"])
def test_step_pieces_give_the_global_mask(layout):
    """For every pair of ranks, mask and window, the step's calls together let through exactly the pairs
    (query, key) the global mask does, each once."""
    for world in (2, 3, 4):
        shard_len = 8
        for causal in (False, True):
            for left in (-1, 0, 1, 3, 9, 30):
                for right in ((-1,) if causal else (-1, 0, 2, 7)):
                    for r in range(world):
                        for j in range(world):
                            q_runs = segments(r, world, shard_len, layout)
                            k_runs = segments(j, world, shard_len, layout)
                            got = set()
                            for p in plan.step_pieces(q_runs, k_runs, causal, left, right):
                                mask = _kernel_mask(p)
                                assert not got & mask, "two calls cover one pair"
                                got |= mask
                            qp, kp = _positions(q_runs), _positions(k_runs)
                            edge = 0 if causal else right
                            want = {(a, b) for a in qp for b in kp
                                    if (edge < 0 or kp[b] <= qp[a] + edge) and (left < 0 or kp[b] >= qp[a] - left)}
                            assert got == want, (world, causal, left, right, r, j)


@pytest.mark.parametrize("layout", ["contiguous", "zigzag"])
def test_documents_give_the_global_mask(layout):
    """Documents packed across the ring: each step's varlen calls (a sequence a document the call meets,
    its mask bottom-right in it) let through exactly the pairs of one document the global mask does."""
    import random

    rng = random.Random(0)
    for world in (2, 3, 4):
        shard_len = 8
        total = world * shard_len
        for _ in range(4):
            cuts = sorted(rng.sample(range(1, total), rng.randint(1, 6)) + [rng.randrange(total)])  # one empty
            boundaries = [0, *cuts, total]
            document = {t: d for d in range(len(boundaries) - 1) for t in range(boundaries[d], boundaries[d + 1])}
            for causal in (False, True):
                for r in range(world):
                    for j in range(world):
                        q_runs = segments(r, world, shard_len, layout)
                        k_runs = segments(j, world, shard_len, layout)
                        got = set()
                        for p in plan.step_pieces(q_runs, k_runs, causal, -1, -1):
                            rows, keys = plan.document_lengths(p, q_runs, k_runs, boundaries)
                            a0, b0 = p.q0, p.k0
                            for n_q, n_k in zip(rows, keys):
                                got |= {(a0 + a, b0 + b) for a in range(n_q) for b in range(n_k)
                                        if not p.causal or b <= a + n_k - n_q}
                                a0, b0 = a0 + n_q, b0 + n_k
                            assert (a0, b0) == (p.q1, p.k1), "the sequences cover the call's rows and keys"
                        qp, kp = _positions(q_runs), _positions(k_runs)
                        want = {(a, b) for a in qp for b in kp
                                if document[qp[a]] == document[kp[b]] and (not causal or kp[b] <= qp[a])}
                        assert got == want, (world, boundaries, causal, r, j)


def test_causal_steps_are_one_call_or_none():
    """Without a window, a causal step is one call: the diagonal, a full one, or none (contiguous: the
    later ranks' keys); zigzag gives every rank the same work (one causal call and world - 1 full calls
    of half the rows or keys)."""
    world, n = 4, 16
    for r in range(world):
        steps = [plan.step_pieces(segments(r, world, n, "contiguous"), segments(j, world, n, "contiguous"), True,
                                  -1, -1) for j in range(world)]
        assert [len(s) for s in steps] == [1] * (r + 1) + [0] * (world - r - 1)
        zig = [plan.step_pieces(segments(r, world, n, "zigzag"), segments(j, world, n, "zigzag"), True, -1, -1)
               for j in range(world)]
        assert all(len(s) == 1 for s in zig)
        work = sorted((p.q1 - p.q0) * (p.k1 - p.k0) for s in zig for p in s)
        assert work == [n * n // 2] * (world - 1) + [n * n]  # the diagonal's n² is half masked


def test_layouts_round_trip():
    x = torch.arange(2 * 24 * 3).reshape(2, 24, 3)
    for world in (1, 2, 3):
        for layout in ("contiguous", "zigzag"):
            shards = [shard(x, r, world, 1, layout) for r in range(world)]
            assert torch.equal(unshard(shards, 1, layout), x)
    z = [zigzag_shard(x, r, 3) for r in range(3)]
    assert torch.equal(z[0][0, :, 0], x[0, [*range(4), *range(20, 24)], 0])
    assert torch.equal(zigzag_unshard(z), x)
    assert torch.equal(torch.cat(z, 1)[0, :, 0], x[0, zigzag_order(3, 8), 0])
    assert zigzag_index(3, 8, "cpu").tolist() == zigzag_order(3, 8)
    with pytest.raises(ValueError, match="multiple of 6"):
        zigzag_shard(torch.zeros(1, 10), 0, 3)
    with pytest.raises(ValueError, match="layout"):
        shard(x, 0, 2, 1, "striped")


def test_merge_is_exact_and_never_nan():
    """Merging partials by LSE gives the attention over their union; rows that saw no key in a part (-inf)
    or in any part stay finite (0, lse -inf)."""
    from tvmflash.distributed.ring import merge

    gen = torch.Generator().manual_seed(0)
    s = torch.randn(1, 2, 3, 10, generator=gen, dtype=torch.float64)  # (batch, heads, rows, keys)
    s[:, :, 2] = -torch.inf  # row 2 sees no key at all
    s[:, :, 1, :5] = -torch.inf  # row 1 sees none of the first part
    v = torch.randn(1, 10, 2, 4, generator=gen, dtype=torch.float64)

    def part(cols):
        lse = torch.logsumexp(s[..., cols], -1)
        p = torch.exp(s[..., cols] - lse[..., None]).nan_to_num(0.0)
        return torch.einsum("bhqk,bkhd->bqhd", p, v[:, cols]), lse

    out = torch.zeros(1, 3, 2, 4, dtype=torch.float64)
    lse = torch.full((1, 2, 3), -torch.inf, dtype=torch.float64)
    for cols in (slice(0, 5), slice(5, 10)):
        merge(out, lse, *part(cols))
    whole_out, whole_lse = part(slice(0, 10))
    assert torch.isfinite(out).all()
    assert torch.allclose(out, whole_out) and torch.equal(lse.isinf(), whole_lse.isinf())
    assert torch.allclose(lse[:, :, :2], whole_lse[:, :, :2])


def ring_overlap():
    import importlib.util

    spec = importlib.util.spec_from_file_location("ring_overlap", ROOT / "benchmarks" / "ring_overlap.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_ring_overlap_dry_run(capsys):
    """benchmarks/ring_overlap.py's plan without a GPU: one row a step kind, the transfer's bytes."""
    module = ring_overlap()
    module.main(["--dry-run", "--shard-lens", "4096", "--world", "4"])
    rows = [line.split() for line in capsys.readouterr().out.splitlines() if line.startswith(("causal", "full"))]
    # zigzag: the diagonal step and 3 of half the rows; full: 4 alike. K+V of 4096 x 16 x 128 bf16: 33.6 MB
    assert [(r[0], r[2]) for r in rows] == [("causal-zigzag", "1"), ("causal-zigzag", "3"), ("full", "4")]
    assert all(r[-6] == "33.6" for r in rows)


def test_ring_overlap_times_the_steps_it_plans():
    """The benchmark's timing of a step (``time_step``: what ring_attention runs) on the CPU, small."""
    import argparse

    module = ring_overlap()
    args = argparse.Namespace(dtype="float32", heads=4, heads_kv=2, head_dim=32, repeat=2)
    kinds = module.step_kinds(64, 4, True, "zigzag")
    assert [count for _, count in kinds] == [1, 3]
    for pieces, _ in kinds:
        forward_ms, backward_ms = module.time_step(pieces, 64, args, torch.device("cpu"))
        assert forward_ms > 0 and backward_ms > 0


def test_a_world_of_one_is_tvmflash_attention():
    """One rank (a gloo group in this process): ring and Ulysses give tvmflash.attention's out and
    gradients bitwise; inside torch.compile the call is a graph break and runs eagerly."""
    import torch.distributed as dist

    import tvmflash
    import tvmflash.distributed as cp

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        gen = torch.Generator().manual_seed(1)
        q, k, v = (torch.randn(1, 64, h, 32, generator=gen).requires_grad_() for h in (4, 2, 2))
        expected = tvmflash.attention(q, k, v, causal=True)
        expected.sum().backward()
        expected_grads = [t.grad for t in (q, k, v)]
        compiled = torch.compile(lambda *a: cp.ring_attention(*a, causal=True) * 1.0, backend="eager")
        for function in (cp.ring_attention, cp.ulysses_attention, compiled):
            for t in (q, k, v):
                t.grad = None
            out = function(q, k, v) if function is compiled else function(q, k, v, causal=True)
            out.sum().backward()
            assert torch.equal(out, expected)
            assert all(torch.equal(t.grad, g) for t, g in zip((q, k, v), expected_grads))
    finally:
        dist.destroy_process_group()
