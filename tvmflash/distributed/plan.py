"""Which kernel calls one ring step makes: the mask between a rank's queries and the keys it holds at
that step, as calls of tvmflash's kernels on slices of them (pure Python; no torch).

Query at global position p sees key at position t when p - left <= t <= p + right (causal: right 0;
-1: no bound on that side). A kernel call on q rows [qa, qb) and k rows [ka, kb) of two runs of
consecutive positions aligns its mask bottom-right: local query a sees local key b when
a + sk - sq - left' <= b <= a + sk - sq + right'. ``piece`` trims the rows no key is visible to and
the keys no row sees, after which the local window (left', right') that gives the global mask is never
negative, so it is a kernel's window. A step's pieces are then joined where one call does their work."""

from __future__ import annotations

import functools
from dataclasses import dataclass


@dataclass(frozen=True)
class Piece:
    """One kernel call: q rows [q0, q1) over k rows [k0, k1) (local rows of the rank's shard and of the
    K/V shard it holds), with ``causal`` and the kernel's ``window`` (left, right) (-1: no bound)."""

    q0: int
    q1: int
    k0: int
    k1: int
    causal: bool
    window: tuple[int, int]

    @property
    def full(self) -> bool:
        """No mask at all: every row sees every key."""
        return not self.causal and self.window == (-1, -1)


def piece(q_run, k_run, causal: bool, left: int, right: int) -> Piece | None:
    """The call for queries at the positions of ``q_run`` over keys at those of ``k_run``, each
    (first global position, one past the last, first local row); None where no query sees a key.
    ``left``, ``right``: the global window (-1: no bound; ``causal`` makes right 0)."""
    (qs, qe, q_local), (ks, ke, k_local) = q_run, k_run
    if causal:
        right = 0
    # the queries that see a key: p + right >= ks and p - left <= ke - 1
    qa = qs if right < 0 else max(qs, ks - right)
    qb = qe if left < 0 else min(qe, ke - 1 + left + 1)
    if qa >= qb:
        return None
    # the keys one of them sees: t >= qa - left and t <= qb - 1 + right
    ka = ks if left < 0 else max(ks, qa - left)
    kb = ke if right < 0 else min(ke, qb + right)
    if ka >= kb:
        return None
    sq, sk = qb - qa, kb - ka
    # local window: a + sk - sq + right' = (qa + a) - ka + right  =>  right' = right + qb - kb, >= 0 as kb <= qb + right
    local_right = -1 if right < 0 else right + qb - kb
    local_left = -1 if left < 0 else left + kb - qb  # >= 0 as kb >= qb - left
    if local_right >= sq - 1:  # query 0 already sees the last key: no bound on the right
        local_right = -1
    if local_left >= sk - 1:  # the last query already sees key 0: no bound on the left
        local_left = -1
    is_causal = local_right == 0
    return Piece(qa - qs + q_local, qb - qs + q_local, ka - ks + k_local, kb - ks + k_local, is_causal,
                 (local_left, -1 if is_causal else local_right))


@functools.lru_cache(maxsize=1024)  # a model calls with the same shapes at every layer and step
def step_pieces(q_runs, k_runs, causal: bool, left: int, right: int) -> tuple[Piece, ...]:
    """The calls of one ring step: the queries at ``q_runs`` over the keys at ``k_runs`` (each a tuple of
    runs as ``piece`` takes, in local order), as few as exactly give the mask. Two cases join: the same
    positions on both sides under a causal mask with no window (one causal call over all of them: the
    positions run in the same order on both sides), and pieces without a mask that tile a rectangle of
    rows and keys (one call over it: zigzag's off-diagonal steps)."""
    if causal and left < 0 and tuple(q_runs) == tuple(k_runs):
        rows = sum(e - s for s, e, _ in q_runs)
        return (Piece(0, rows, 0, rows, True, (-1, -1)),)
    pieces = [p for q_run in q_runs for k_run in k_runs if (p := piece(q_run, k_run, causal, left, right))]
    if len(pieces) > 1 and all(p.full for p in pieces):
        rows = sorted({(p.q0, p.q1) for p in pieces})
        keys = sorted({(p.k0, p.k1) for p in pieces})
        adjacent = all(a[1] == b[0] for pairs in (rows, keys) for a, b in zip(pairs, pairs[1:]))
        if adjacent and len(pieces) == len(rows) * len(keys):
            return (Piece(rows[0][0], rows[-1][1], keys[0][0], keys[-1][1], False, (-1, -1)),)
    return tuple(pieces)


# ----------------------------------------------------------------------------- documents (varlen)
# Documents packed in one sequence (flash-attn's cu_seqlens over the whole sequence): each call of a
# step runs the varlen kernel, each document one of its sequences, with the document's rows among the
# call's rows and its keys among the call's keys (either may be none). Without a window every call is
# exact per document: in a causal call the rows and keys are the same positions (so each document's
# are too, and its mask is its own causal one), in a full call every key precedes every row or there is
# no mask at all.
def positions(lo: int, hi: int, runs) -> list[tuple[int, int]]:
    """The global position ranges of local rows [lo, hi) of ``runs`` (as ``piece`` takes them)."""
    found = []
    for start, end, local in runs:
        a, b = max(lo, local), min(hi, local + end - start)
        if a < b:
            found.append((start + a - local, start + b - local))
    return found


def document_rows(ranges, boundaries) -> dict[int, int]:
    """{document: how many of its positions lie in ``ranges``}, documents by ``boundaries`` (cu_seqlens
    as a list: document i is positions boundaries[i] ... boundaries[i + 1] - 1)."""
    import bisect

    counts: dict[int, int] = {}
    last = len(boundaries) - 1
    for s, e in ranges:
        d = bisect.bisect_right(boundaries, s) - 1
        while d < last and boundaries[d] < e:
            n = min(e, boundaries[d + 1]) - max(s, boundaries[d])
            if n > 0:
                counts[d] = counts.get(d, 0) + n
            d += 1
    return counts


def document_lengths(p: Piece, q_runs, k_runs, boundaries) -> tuple[list[int], list[int]]:
    """(rows, keys) of each document that the call ``p`` meets, in order: its sequences' lengths."""
    rows = document_rows(positions(p.q0, p.q1, q_runs), boundaries)
    keys = document_rows(positions(p.k0, p.k1, k_runs), boundaries)
    documents = sorted(set(rows) | set(keys))
    return [rows.get(d, 0) for d in documents], [keys.get(d, 0) for d in documents]
