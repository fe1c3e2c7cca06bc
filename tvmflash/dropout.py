"""flash-attn's dropout on the torch side: the seeds of the calls (``philox_state``, flash-attn's int64 (seed,
offset) rng_state drawn from torch's generator), and which entries the kernels keep (``dropout_kept``), the
programs' rule (``program_dropout``: Philox4x32-10 of a seed, an offset and each entry's place, so the
backward recomputes the forward's pattern from them alone) on torch tensors, the reference the kernels and
``return_attn_probs`` are tested against."""

from __future__ import annotations

import math

import torch

from tvmflash.kernels.checks import check_dropout_p, check_dropout_seed
from tvmflash.lowering.philox import PHILOX_MULTIPLIERS, PHILOX_ROUNDS, PHILOX_WEYL
from tvmflash.program_dropout import DROPOUT_BITS, GROUP_BIT


def dropout_arguments(dropout_p: float, dropout_seed) -> dict:
    """A kernel call's dropout keywords: none at a rate of 0 (a kernel without dropout runs)."""
    return {"dropout_p": dropout_p, "dropout_seed": dropout_seed} if dropout_p > 0 else {}


def philox_state(device: torch.device, streams: int) -> torch.Tensor:
    """The ``dropout_seed`` of a call that uses ``streams`` (batch · heads_q) Philox streams: flash-attn's
    rng_state, int64 (seed, offset) on ``device``, drawn from torch's default generator for the device.

    On a CUDA device, eagerly, as flash-attn's ``philox_cuda_state``: the generator's seed and Philox
    offset, the offset then advanced by ``streams`` (rounded up to a multiple of 4, as torch's own
    kernels advance it), so the next call, and torch's own random kernels, draw other numbers; the two
    numbers reach the device by a copy that does not wait for it. Where a number read on the host would
    be frozen into a graph (torch.compile's tracing, CUDA graph capture) and on the CPU (torch's CPU
    generator is a Mersenne twister, without a Philox offset): both drawn on the device from the
    generator (``torch.randint``), which the graph draws anew at each replay. Either way
    ``torch.manual_seed`` repeats a run."""
    if (device is not None and torch.device(device).type == "cuda" and not torch.compiler.is_compiling()
            and not torch.cuda.is_current_stream_capturing()):
        index = torch.device(device).index
        generator = torch.cuda.default_generators[torch.cuda.current_device() if index is None else index]
        seed, offset = generator.initial_seed(), generator.get_offset()
        generator.set_offset(offset + -(-streams // 4) * 4)
        state = torch.tensor([seed - 2**64 if seed >= 2**63 else seed, offset], dtype=torch.int64)
        return state.pin_memory().to(device, non_blocking=True)
    return torch.randint(0, 2**62, (2,), dtype=torch.int64, device=device)  # offsets far from 2^64: no wrap


def resolve_dropout(dropout_p, dropout_seed, device: torch.device, streams: int) -> tuple:
    """(dropout_p, seed): the rate checked (``checks.check_dropout_p``) and, where it is above 0, the given
    seed checked, or a new one drawn for a call of ``streams`` (batch · heads_q) streams
    (``philox_state``); seed None at a rate of 0."""
    dropout_p = check_dropout_p(dropout_p)
    if not dropout_p:
        return 0.0, None
    if dropout_seed is None:
        return dropout_p, philox_state(device, streams)
    return dropout_p, check_dropout_seed(dropout_seed, device)


_WORD = 0xFFFFFFFF


def _mulhilo(multiplier: int, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(high, low) words of multiplier · x, uint32 values in int64 tensors, in 16-bit halves of x so no
    product passes 2^63."""
    low_half, high_half = multiplier * (x & 0xFFFF), multiplier * (x >> 16)
    low = low_half + ((high_half & 0xFFFF) << 16)
    return (high_half >> 16) + (low >> 32), low & _WORD


def philox(counter, key) -> tuple[torch.Tensor, ...]:
    """Philox4x32-10 (``lowering.philox``) of four counter words and two key words, int64 tensors (or
    ints) holding uint32 values, broadcast: the four output words, likewise."""
    (m0, m1), (w0, w1) = PHILOX_MULTIPLIERS, PHILOX_WEYL
    c0, c1, c2, c3 = (torch.as_tensor(c, dtype=torch.int64) for c in counter)
    k0, k1 = (torch.as_tensor(k, dtype=torch.int64) for k in key)
    for _ in range(PHILOX_ROUNDS):
        (hi0, lo0), (hi1, lo1) = _mulhilo(m0, c0), _mulhilo(m1, c2)
        c0, c1, c2, c3 = hi1 ^ c1 ^ k0, lo1, hi0 ^ c3 ^ k1, lo0
        k0, k1 = (k0 + w0) & _WORD, (k1 + w1) & _WORD
    return c0, c1, c2, c3


def dropout_kept(dropout_seed: torch.Tensor, dropout_p: float, heads_q: int, b, h, rows, cols) -> torch.Tensor:
    """Which entries the kernels keep: a bool tensor, the broadcast of the int tensors ``b`` (batch, or
    varlen's sequence), ``h`` (query head of ``heads_q``), ``rows`` (query) and ``cols`` (key), positions
    in each sequence: the programs' rule (``program_dropout``) on torch tensors; ``dropout_seed``, int64
    (seed, offset)."""
    device = dropout_seed.device
    seed, offset = dropout_seed.to(torch.int64)

    def positions(x):
        return torch.as_tensor(x, dtype=torch.int64, device=device)
    stream = (offset & _WORD) + positions(b) * heads_q + positions(h)  # below 2^63: exact
    stream_words = (stream & _WORD, ((offset >> 32) + (stream >> 32)) & _WORD)
    rows, cols = positions(rows) & _WORD, positions(cols) & _WORD
    group = 1 << GROUP_BIT
    row_counter = (rows >> (GROUP_BIT + 1)) << GROUP_BIT | (rows & (group - 1))
    key_counter = (cols >> (GROUP_BIT + 1)) << (GROUP_BIT - 1) | (cols & (group - 1)) >> 1
    words = philox((row_counter, key_counter, *stream_words), (seed & _WORD, (seed >> 32) & _WORD))
    which = (rows >> GROUP_BIT & 1) | (cols >> GROUP_BIT & 1) << 1
    words = torch.stack(torch.broadcast_tensors(*words, which), -1)
    bits = words[..., :4].gather(-1, words[..., 4:])[..., 0]
    half = (bits >> (DROPOUT_BITS * (cols & 1))) & ((1 << DROPOUT_BITS) - 1)
    threshold = math.ceil(float(torch.tensor(dropout_p, dtype=torch.float32)) * 2.0**DROPOUT_BITS)
    return half >= threshold


def dropout_mask(dropout_seed: torch.Tensor, dropout_p: float, batch: int, heads_q: int, seqlen_q: int,
                 seqlen_k: int) -> torch.Tensor:
    """``dropout_kept`` of every entry of a dense call: bool (batch, heads_q, seqlen_q, seqlen_k)."""
    device = dropout_seed.device
    return dropout_kept(dropout_seed, dropout_p, heads_q, torch.arange(batch, device=device)[:, None, None, None],
                        torch.arange(heads_q, device=device)[None, :, None, None],
                        torch.arange(seqlen_q, device=device)[:, None], torch.arange(seqlen_k, device=device))
