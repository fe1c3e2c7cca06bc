"""tvmflash.flex_attention with torch's BlockMask: block sparsity, forward and backward.

Each Q block walks its BlockMask row's list of K/V blocks (kv_num_blocks, kv_indices, then full_kv_*), dkdv
walks each K/V block's list of Q blocks (q_num_blocks, q_indices, full_q_*), dq its Q block's K/V list; full
blocks skip mask_mod. Checked against a float64 reference that applies the BlockMask as torch defines it
(an element is seen where its block is full, or partial and mask_mod holds; never in an empty block), under
flash-attn's error rule, forward and gradients; and by poisoning: NaN in the K/V rows of blocks that no
list holds, which a visit would spread (0 · NaN in p·v, ds·k), leaves every output and gradient finite and
equal to the clean run's. The CPU cases keep to one dtype, head_dim and head layout (GQA 4/2)."""

import dataclasses
import math

import pytest
import torch
from reference import check_gradient_errors
from test_flex import HEADS, check_forward, documents, flex_reference, random_qkv
from torch.nn.attention.flex_attention import BlockMask, create_block_mask

import tvmflash
from tvmflash import flex_block_mask, program_block_sparse
from tvmflash import target as targets
from tvmflash.flex_trace import trace_mods
from tvmflash.lowering import pipeline

CPU_DTYPE, CPU_HEAD_DIM = torch.float16, 32
# (seqlen_q, seqlen_k): tails on both sides, several blocks of 64 and of 128
LENGTHS = [(300, 300), (200, 333)]
GPU_LENGTHS = LENGTHS + [(1000, 1000), (2048, 2048)]


def _ceildiv(a, b):
    return -(-a // b)


def block_states(block_mask: BlockMask, seqlen_q: int, seqlen_k: int) -> torch.Tensor:
    """(B, H, q_blocks, kv_blocks) int: 0 empty, 1 partial (mask_mod applies), 2 full."""
    num, indices = block_mask.kv_num_blocks, block_mask.kv_indices
    columns = _ceildiv(seqlen_k, block_mask.BLOCK_SIZE[1])
    state = torch.zeros((*num.shape, columns + 1), dtype=torch.int64, device=num.device)
    lists = [(num, indices, 1)]
    if block_mask.full_kv_num_blocks is not None:
        lists.append((block_mask.full_kv_num_blocks, block_mask.full_kv_indices, 2))
    for n, idx, value in lists:
        n, idx = n.expand(*state.shape[:3]), idx.expand(*state.shape[:3], idx.shape[-1])
        listed = torch.arange(idx.shape[-1], device=idx.device) < n[..., None]
        where = torch.where(listed, idx.long(), columns)  # past the list: the spare column
        state.scatter_(-1, where, torch.full_like(where, value))
    return state[..., :columns]


def effective_mask(block_mask: BlockMask, mask_mod, seqlen_q: int, seqlen_k: int, batch: int, heads: int):
    """The BlockMask as torch applies it, element by element: (B, H, seqlen_q, seqlen_k) bool."""
    block_q, block_kv = block_mask.BLOCK_SIZE
    state = block_states(block_mask, seqlen_q, seqlen_k)
    state = state.repeat_interleave(block_q, -2)[..., :seqlen_q, :].repeat_interleave(block_kv, -1)[..., :seqlen_k]
    device = state.device
    b = torch.arange(batch, device=device)[:, None, None, None]
    h = torch.arange(heads, device=device)[None, :, None, None]
    i = torch.arange(seqlen_q, device=device)[:, None]
    j = torch.arange(seqlen_k, device=device)[None, :]
    partial = mask_mod(b, h, i, j) if mask_mod is not None else torch.ones((), dtype=torch.bool, device=device)
    return (state == 2) | ((state == 1) & partial)


def random_block_mask(batch, heads, seqlen_q, seqlen_k, block, device, seed, empty_rows=()):
    """A BlockMask of random empty, partial and full blocks per (batch, head), with whole rows of
    blocks empty (``empty_rows``: their queries see no key); partial blocks keep (q + 2 kv) % 3 != 0."""
    gen = torch.Generator().manual_seed(seed)
    rows, cols = _ceildiv(seqlen_q, block), _ceildiv(seqlen_k, block)
    state = torch.randint(0, 3, (batch, heads, rows, cols), generator=gen)
    for row in empty_rows:
        state[:, :, row] = 0

    def lists(value):
        hit = state == value
        order = torch.argsort((~hit).to(torch.int32), dim=-1, stable=True)  # the listed blocks first
        return hit.sum(-1).to(torch.int32).to(device), order.to(torch.int32).to(device)

    def partial(b, h, q, kv):
        return (q + 2 * kv) % 3 != 0

    (num, indices), (full_num, full_indices) = lists(1), lists(2)
    return BlockMask.from_kv_blocks(num, indices, full_num, full_indices, BLOCK_SIZE=block, mask_mod=partial,
                                    seq_lengths=(seqlen_q, seqlen_k))


def masks(seqlen_q: int, seqlen_k: int, device, batch: int = 2) -> dict:
    """name -> (score_mod, BlockMask) for these lengths on ``device``."""
    doc_q, doc_k = documents(seqlen_q, device), documents(seqlen_k, device)
    window = 70

    def causal(b, h, q, kv):
        return q >= kv

    def sliding_window(b, h, q, kv):
        return (q - kv <= window) & (q - kv >= 0)

    def document(b, h, q, kv):
        return doc_q[q] == doc_k[kv]

    def make(mask_mod, block, batch_=None, heads=None):
        return create_block_mask(mask_mod, batch_, heads, seqlen_q, seqlen_k, device=device, BLOCK_SIZE=block)

    return {
        "causal": (None, make(causal, 128)),
        "sliding-window": (None, make(sliding_window, 64)),
        "document": (lambda s, b, h, q, kv: torch.tanh(s / 4.0) * 4.0, make(document, 64, batch, HEADS[0])),
        "random": (None, random_block_mask(batch, HEADS[0], seqlen_q, seqlen_k, 64, device, seed=seqlen_q)),
        "empty-rows": (None, random_block_mask(1, 1, seqlen_q, seqlen_k, 64, device, seed=seqlen_k, empty_rows=(0, 2))),
        "random32": (None, random_block_mask(batch, 1, seqlen_q, seqlen_k, 32, device, seed=seqlen_q + 1)),
    }


def forward_and_gradients_match_float64(device, dtype, head_dim, name, lengths):
    for n, (seqlen_q, seqlen_k) in enumerate(lengths):
        score_mod, block_mask = masks(seqlen_q, seqlen_k, device)[name]
        q, k, v = random_qkv(2, seqlen_q, seqlen_k, dtype, device, head_dim, seed=seqlen_q + 7 * seqlen_k)
        dense = effective_mask(block_mask, block_mask.mask_mod, seqlen_q, seqlen_k, 2, HEADS[0])

        def mask_mod(b, h, i, j):
            return dense
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        out, lse = tvmflash.flex_attention(*leaves, score_mod=score_mod, block_mask=block_mask, enable_gqa=True,
                                           return_lse=True)
        check_forward(out.detach(), lse.detach(), q, k, v, score_mod, mask_mod)
        dout = torch.randn_like(out)
        dlse = torch.randn_like(lse).masked_fill(~torch.isfinite(lse.detach()), 0.0) if n % 2 else None
        torch.autograd.backward([out, lse] if n % 2 else [out], [dout, dlse] if n % 2 else [dout])
        for t in leaves:
            assert torch.isfinite(t.grad).all(), "a gradient has NaN/inf"
        refs = []
        for ref_dtype in (torch.float64, dtype):
            ref_leaves = [t.detach().to(ref_dtype).requires_grad_() for t in (q, k, v)]
            ref_out, ref_lse = flex_reference(*ref_leaves, score_mod, mask_mod, dtype=ref_dtype)
            loss = (ref_out * dout.to(ref_dtype)).sum()
            if dlse is not None:
                loss = loss + (ref_lse.masked_fill(ref_lse == -math.inf, 0) * dlse.to(ref_dtype)).sum()
            refs.append(torch.autograd.grad(loss, ref_leaves))
        check_gradient_errors([t.grad for t in leaves], *refs, dtype)
        if name == "empty-rows":  # the queries of the empty rows of blocks (0 and 2, of 64): 0, lse -inf, dq 0
            rows = torch.cat([torch.arange(0, 64), torch.arange(128, 192)])
            assert not out[:, :, rows].any() and torch.isneginf(lse[:, :, rows]).all()
            assert not leaves[0].grad[:, :, rows].any()


NAMES = [name for name in masks(300, 300, "cpu") if name != "random32"]
# On the CPU the masks that exercise the walk's cases (partial and full blocks, rows of no block); the
# others' mask_mods are test_flex's, and every mask runs on the GPU (GPU_CASES): the CPU suite's time
CPU_NAMES = ("causal", "random", "empty-rows")


@pytest.mark.parametrize("name", CPU_NAMES)
def test_forward_and_gradients_match_float64_on_cpu(name):
    forward_and_gradients_match_float64("cpu", CPU_DTYPE, CPU_HEAD_DIM, name, LENGTHS)


def poisoned_blocks_are_not_visited(device, dtype, head_dim):
    """Keys 128 ... 255 (K/V blocks 2 and 3 of 64) are in no list, and mask_mod hides them too; NaN in
    their K and V rows spreads to every output and gradient that a visit touches (p·v with p 0 is
    0 · NaN; so are dsᵀ q and ds k), so finite results equal to the clean run's show they are skipped by
    the forward, dkdv and dq."""
    seqlen = 400

    def mask_mod(b, h, q, kv):
        return ((kv < 128) | (kv >= 256)) & (kv <= q + 100)
    block_mask = create_block_mask(mask_mod, None, None, seqlen, seqlen, device=device, BLOCK_SIZE=64)
    q, k, v = random_qkv(2, seqlen, seqlen, dtype, device, head_dim, seed=11)
    results = []
    for poison in (False, True):
        k2, v2 = k.clone(), v.clone()
        if poison:
            k2[:, :, 128:256] = math.nan
            v2[:, :, 128:256] = math.nan
        leaves = [t.requires_grad_() for t in (q.clone(), k2, v2)]
        out, lse = tvmflash.flex_attention(*leaves, block_mask=block_mask, enable_gqa=True, return_lse=True)
        (out.float().square().sum() + lse.masked_fill(torch.isneginf(lse), 0).sum()).backward()
        results.append([out, lse, *(t.grad for t in leaves)])
    for name, clean, poisoned in zip(("out", "lse", "dq", "dk", "dv"), *results):
        finite = torch.isfinite(poisoned) | torch.isneginf(clean)  # (lse -inf where a row sees no key)
        assert finite.all(), f"{name}: a poisoned (empty) block was visited"
        if name == "dq" and device != "cpu":  # summed by atomics on sm90 (dq_atomic): in any order
            error = (clean.float() - poisoned.float()).abs().max().item()
            assert error <= 1e-2 * clean.float().abs().max().item(), f"dq: differs by {error:.3e}"
        else:
            assert torch.equal(clean, poisoned), f"{name}: differs from the run without the poisoned rows"
    dk, dv = results[1][3], results[1][4]
    assert not dk[:, :, 128:256].any() and not dv[:, :, 128:256].any()
    check_forward(results[0][0].detach(), results[0][1].detach(), q, k, v, None, mask_mod)


def test_empty_blocks_are_not_visited_on_cpu():
    poisoned_blocks_are_not_visited("cpu", CPU_DTYPE, CPU_HEAD_DIM)


@pytest.mark.skipif(not targets.host_amx(), reason="needs a host CPU with AMX bf16 (amx_tile, amx_bf16)")
def test_block_masks_on_amx():
    """bf16 on the CPU: the AMX forward (and the CPU schedule's backward) walk the lists too."""
    mods = dataclasses.replace(trace_mods(None, lambda b, h, q, kv: q >= kv)[0], sparse=(64, 64))
    assert flex_block_mask.compile_flex(CPU_HEAD_DIM, "bfloat16", "cpu", mods).info()["schedule"] == "amx"
    forward_and_gradients_match_float64("cpu", torch.bfloat16, CPU_HEAD_DIM, "random", LENGTHS)
    poisoned_blocks_are_not_visited("cpu", torch.bfloat16, CPU_HEAD_DIM)


def test_a_reused_block_mask_is_converted_once_and_again_when_changed_in_place():
    q, k, v = random_qkv(1, 200, 200, CPU_DTYPE, "cpu", CPU_HEAD_DIM, seed=8)
    block_mask = random_block_mask(1, 1, 200, 200, 64, "cpu", seed=4)
    first = flex_block_mask.block_sparse_lists(block_mask, 1, HEADS[0], 200, 200, q.device)
    assert flex_block_mask.block_sparse_lists(block_mask, 1, HEADS[0], 200, 200, q.device) is first
    block_mask.kv_num_blocks[..., 1] = 0  # Q block 1: no partial block left, its full ones only
    block_mask.full_kv_num_blocks[..., 2] = 0  # Q block 2: no full block left
    out, lse = tvmflash.flex_attention(q, k, v, block_mask=block_mask, enable_gqa=True, return_lse=True)
    dense = effective_mask(block_mask, block_mask.mask_mod, 200, 200, 1, HEADS[0])
    check_forward(out, lse, q, k, v, None, lambda b, h, i, j: dense)


def test_mismatched_and_stale_block_masks_are_refused():
    q, k, v = random_qkv(2, 200, 200, CPU_DTYPE, "cpu", CPU_HEAD_DIM, seed=5)

    def causal(b, h, q_idx, kv):
        return q_idx >= kv
    odd = create_block_mask(causal, None, None, 200, 200, device="cpu", BLOCK_SIZE=24)  # the CPU's tiles are 64
    with pytest.raises(ValueError, match=r"BLOCK_SIZE 24x24 .* not a multiple of the tiles of any schedule .* cpu:"):
        tvmflash.flex_attention(q, k, v, block_mask=odd, enable_gqa=True)
    with pytest.raises(ValueError, match=r"BLOCK_SIZE 24x24 .* not a multiple of the kernel's tile 64x64"):
        program_block_sparse.check_sparse_tiles((24, 24), 64, 64)
    stale = create_block_mask(causal, None, None, 100, 200, device="cpu")
    with pytest.raises(ValueError, match="block_mask: made for"):
        tvmflash.flex_attention(q, k, v, block_mask=stale, enable_gqa=True)
    other_batch = create_block_mask(causal, 3, None, 200, 200, device="cpu")
    with pytest.raises(ValueError, match=r"block_mask.kv_num_blocks: expected \(batch 1 or 2"):
        tvmflash.flex_attention(q, k, v, block_mask=other_batch, enable_gqa=True)
    bad = BlockMask.from_kv_blocks(torch.full((1, 1, 4), 9, dtype=torch.int32),
                                   torch.zeros((1, 1, 4, 4), dtype=torch.int32), BLOCK_SIZE=64, seq_lengths=(200, 200))
    with pytest.raises(ValueError, match="counts out of range"):
        tvmflash.flex_attention(q, k, v, block_mask=bad, enable_gqa=True)


def test_blocks_smaller_than_the_default_tiles_take_tiles_that_divide_them():
    """A BlockMask of 32 x 32 blocks where the CPU's default tiles are 64 x 64: the kernels take 32-row and
    32-key tiles (``flex_block_mask.fitted_tiles``), forward and backward."""
    forward_and_gradients_match_float64("cpu", CPU_DTYPE, CPU_HEAD_DIM, "random32", LENGTHS[:1])
    assert flex_block_mask.fitted_tiles({"block_m": 128, "block_n": 64, "vec": 8}, (64, 128)) == {"block_m": 64}


@pytest.mark.parametrize("target,dtype,block,backward,expected", [
    ("sm90", "bfloat16", (128, 128), False, ("sm90", {"block_m": 128, "block_n": 64})),
    ("sm90", "bfloat16", (64, 64), False, ("sm90", {"block_m": 64, "block_n": 64})),
    ("sm90", "bfloat16", (64, 64), True, ("sm90", {"block_m": 64, "block_n": 64, "dq_block_m": 64, "dq_block_n": 64})),
    ("sm90", "bfloat16", (32, 32), False, ("sm80", {"block_m": 32, "block_n": 32})),  # sm90 takes 64 rows or more
    # sm80's dkdv: 16 keys a warp at the least, so 2 warps for 32 keys
    ("sm90", "bfloat16", (32, 32), True, ("sm80", {"block_m": 32, "block_n": 32, "dkdv_warps": 2})),
    ("sm80", "float16", (64, 128), False, ("sm80", {"block_m": 64, "block_n": 64})),
    ("sm80", "float16", (16, 16), True, ("simt", {"block_m": 16, "block_n": 16})),
])
def test_each_schedule_takes_tiles_that_divide_the_blocks(target, dtype, block, backward, expected):
    """Cross-compiled kernels: the schedule chosen for a BlockMask's BLOCK_SIZE and its tiles, and (the
    backward, whose schedules check their tiles) its CUDA source made."""
    mods = dataclasses.replace(trace_mods(None, lambda b, h, q, kv: q >= kv)[0], sparse=block)
    kernel = flex_block_mask.compile_flex(128 if target == "sm90" else 64, dtype, target, mods, backward)
    assert (kernel.schedule.name, {name: kernel.knobs[name] for name in expected[1]}) == expected
    if backward and target == "sm90":
        assert "dkdv_kernel" in kernel.source(heads_q=4, heads_kv=2)


def test_a_block_mask_without_a_mask_mod_walks_its_lists():
    """create_block_mask(noop_mask) (every block full) and a BlockMask of lists alone: the flex kernels,
    which skip the empty blocks (a plain attention would see every key)."""
    from torch.nn.attention.flex_attention import noop_mask

    q, k, v = random_qkv(1, 130, 200, CPU_DTYPE, "cpu", CPU_HEAD_DIM, seed=6)
    full = create_block_mask(noop_mask, None, None, 130, 200, device="cpu")
    out, lse = tvmflash.flex_attention(q, k, v, block_mask=full, enable_gqa=True, return_lse=True)
    check_forward(out, lse, q, k, v, None, None)
    block_mask = random_block_mask(1, 1, 130, 200, 64, "cpu", seed=9)
    dense = effective_mask(block_mask, block_mask.mask_mod, 130, 200, 1, HEADS[0])
    out, lse = tvmflash.flex_attention(q, k, v, block_mask=block_mask, enable_gqa=True, return_lse=True)
    check_forward(out, lse, q, k, v, None, lambda b, h, i, j: dense)


# ----------------------------------------------------------------------------- CUDA, cross-compiled
def _sparse_mods():
    mods, _ = trace_mods(None, lambda b, h, q, kv: q >= kv)
    return dataclasses.replace(mods, sparse=(128, 128))


# the backward: the lowering's producer warpgroup with a trip count read from the lists
@pytest.mark.parametrize("program", ["forward", "backward"])
def test_sm90_cuda_of_a_block_mask_builds(program):
    """The sm90 schedule (wgmma, TMA K/V copies at a tile index read from the lists) with a BlockMask:
    built without a GPU. The list is read once a step (``lowering.uniformity.BindStepLoads``): in the
    prologue, the producer's and the consumers' steps and the epilogue, not in each copy and each score's
    mask (hundreds of reads, 0.5 to 2 MB of CUDA and builds of 13 to 37 s, where these take 2 to 4)."""
    compile_ = tvmflash.compile_backward if program == "backward" else tvmflash.compile
    kernel = compile_(head_dim=128, dtype="bfloat16", target="sm90", flex=_sparse_mods())
    source = kernel.source(heads_q=4, heads_kv=2)
    lists = "QIndices" if program == "backward" else "KvIndices"
    assert lists in source and "wgmma" in source and "cp.async.bulk.tensor" in source
    assert source.count(f"{lists}_ptr[") <= 6, source.count(f"{lists}_ptr[")


@pytest.mark.parametrize("program", ["forward", "backward"])
def test_sm90_full_tiles_of_a_block_mask_skip_the_mask_as_the_built_in_causal_does(program):
    """A causal mask_mod with its BlockMask costs what the built-in causal does (issue 45: within 3%). A full
    block's tile takes the scores as they are, under one test a K/V step (a Q step in dkdv) that
    ``lowering.uniformity.HoistBlockIndexConditions`` moves out of the score loops, where it was made for each
    score (32 a thread); a partial tile's score is masked by q_idx >= kv_idx on the positions as they are (no
    clamp into the sequence: nothing loads or divides by them), the sequence's end and the full-block test:
    three comparisons, where the built-in causal makes two."""
    import re
    compile_ = tvmflash.compile_backward if program == "backward" else tvmflash.compile
    source = compile_(head_dim=128, dtype="bfloat16", target="sm90", flex=_sparse_mods()).source(heads_q=4, heads_kv=2)
    full_tile = re.findall(r"^\s*if \(\(\((\w+) \* 2\) <= [^|]*\) && \(", source, re.M)
    assert 1 <= len(full_tile) <= 2, full_tile
    counts = full_tile[0]
    scores = [line for line in source.splitlines()
              if re.match(r"\s*if \(.*threadIdx", line) and f"({counts} * 2) <=" in line]
    assert scores, "no masked score"
    for line in scores:
        comparisons = len(re.findall(r" <=? ", line))
        assert comparisons == 3 and "min(" not in line, line


def test_the_lowering_names_the_block_lists():
    """The lowering reads the lists by their names (``lowering.pipeline.BLOCK_LISTS``), the programs'."""
    assert pipeline.BLOCK_LISTS == program_block_sparse.SPARSE_ARGUMENTS
    assert set(pipeline.BLOCK_COUNTS) == {name for name in program_block_sparse.SPARSE_ARGUMENTS if name.endswith("Counts")}


@pytest.mark.parametrize("program", ["forward"])  # its backward: the GPU tests' sm80 case
def test_sm80_cuda_of_a_block_mask_builds(program):
    compile_ = tvmflash.compile_backward if program == "backward" else tvmflash.compile
    source = compile_(head_dim=64, dtype="float16", target="sm80", flex=_sparse_mods()).source(heads_q=4, heads_kv=2)
    assert "mma.sync" in source and ("QIndices" if program == "backward" else "KvIndices") in source


# ----------------------------------------------------------------------------- on the GPU
GPU_CASES = ([(torch.bfloat16, 128, name) for name in NAMES]
             + [(torch.float16, 64, name) for name in ("document", "random", "empty-rows")])


@pytest.mark.gpu
@pytest.mark.parametrize("dtype,head_dim,name", GPU_CASES, ids=str)
def test_forward_and_gradients_match_float64_on_the_gpu(dtype, head_dim, name):
    forward_and_gradients_match_float64("cuda", dtype, head_dim, name, GPU_LENGTHS)


@pytest.mark.gpu
@pytest.mark.parametrize("schedule", ["default", "sm80", "simt"])
def test_empty_blocks_are_not_visited_on_the_gpu(schedule, monkeypatch):
    if schedule != "default":
        monkeypatch.setenv("TVMFLASH_BACKWARD", schedule)
    if schedule == "sm80":
        monkeypatch.setenv("TVMFLASH_SM90", "0")
    dtype = torch.float32 if schedule == "simt" else torch.bfloat16
    poisoned_blocks_are_not_visited("cuda", dtype, 64 if schedule == "simt" else 128)


@pytest.mark.gpu
@pytest.mark.parametrize("schedule", ["sm80", "simt"])
def test_block_masks_on_the_other_gpu_schedules(schedule, monkeypatch):
    monkeypatch.setenv("TVMFLASH_BACKWARD", schedule)
    if schedule == "sm80":
        monkeypatch.setenv("TVMFLASH_SM90", "0")
    dtype = torch.float32 if schedule == "simt" else torch.float16
    for name in ("random", "empty-rows", "document"):
        forward_and_gradients_match_float64("cuda", dtype, 64, name, GPU_LENGTHS)
