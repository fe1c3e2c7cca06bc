"""Helpers shared by the schedules."""

from __future__ import annotations

import hashlib
import re

import tvm
import tvm_ffi

from tvmflash import tvmscript
from tvmflash.lowering.annotations import PERSISTENT_WALK, REVERSED


def element_bytes(sch: tvm.s_tir.Schedule, block_name: str) -> int:
    """Bytes per element of the buffer a block writes (the program's dtype, for the load blocks)."""
    written = sch.get(sch.get_sblock(block_name)).writes[0].source
    return tvm.DataType(str(written.dtype)).bits // 8


def buffer_info(sch):
    """(dtype, block_m, head_dim, block_n) of a scheduled attention program, from its load blocks."""
    qt = sch.get(sch.get_sblock("load_q")).writes[0].source
    kt = sch.get(sch.get_sblock("load_k")).writes[0].source
    return str(qt.dtype), int(qt.shape[0]), int(qt.shape[1]), int(kt.shape[0])


def steps_depend_on_tile_block(sch: tvm.s_tir.Schedule, steps: str) -> bool:
    """Does the number of steps a tile takes (the loop of the block ``steps``: "kv_step" in the forward,
    "q_step" in dkdv) depend on the tile's block (its third index: the Q block, the K/V block), as under
    causal masks and windows?"""
    block = sch.get(sch.get_sblock("tile")).iter_vars[2].var
    extent = sch.get(sch.get_loops(steps)[-1]).extent
    found = []
    tvm_ffi.structural_walk(extent, (type(block), lambda v: found.append(v.same_as(block))))
    return any(found)


def bind_grid(sch: tvm.s_tir.Schedule) -> None:
    """One thread block per tile. The GPU starts thread blocks in the order of blockIdx x, then y,
    then z:
      * equal work per Q block: (batch, head, Q block) -> blockIdx.(z, y, x), a head's Q blocks
        side by side (they read the same K/V);
      * work growing with the Q block (causal): (batch, Q block, head) -> blockIdx.(z, y, x) with the
        Q blocks last to first, so the heaviest start first and the lightest fill the tail
        (longest-processing-time first), and a batch's heads run side by side with their K/V in
        L2. Measured faster than the equal-work grid and than this grid with the Q blocks first to last
        (BENCHMARKS.md)."""
    b, h, qb = sch.get_loops("tile")
    if steps_depend_on_tile_block(sch, "kv_step"):
        sch.reorder(b, qb, h)
        sch.annotate(qb, REVERSED, 1)
        sch.bind(h, "blockIdx.x")
        sch.bind(qb, "blockIdx.y")
    else:
        sch.bind(qb, "blockIdx.x")
        sch.bind(h, "blockIdx.y")
    sch.bind(b, "blockIdx.z")


def dkdv_grid(sch: tvm.s_tir.Schedule, dq_atomic: bool, persistent_blocks: int = 0):
    """What the tensor-core schedules of the backward's dkdv share: the steps over the GQA group's query
    heads and Q blocks as one loop; (batch, K/V head, K/V block) -> blockIdx.(z, y, x), so that with a
    causal mask the first K/V blocks, which see the most Q blocks, start first (with ``persistent_blocks``,
    that many thread blocks walk the tiles instead: ``persistent_walk``); and with ``dq_atomic``
    the copy of dsᵀ to shared memory that dq's share reads, made before ds takes its register layout
    (so that the copy keeps the logical one). Returns that copy's block, or None."""
    sch.fuse(*sch.get_loops("q_step")[-2:])
    b, hk, kb = sch.get_loops("tile")
    if persistent_blocks:
        persistent_walk(sch, persistent_blocks)
    else:
        sch.bind(kb, "blockIdx.x")
        sch.bind(hk, "blockIdx.y")
        sch.bind(b, "blockIdx.z")
    return sch.cache_read("dq", 0, "shared.dyn", consumer_blocks=["dq"]) if dq_atomic else None


def persistent_walk(sch: tvm.s_tir.Schedule, blocks: int) -> None:
    """dkdv's (batch, K/V head, K/V block) tiles walked by ``blocks`` persistent thread blocks
    (blockIdx.x), each taking every ``blocks``-th tile of one fused order (static striding), so that
    no tile's start or end is a thread block's launch or exit, and the TMA lowering carries its
    pipeline from one tile into the next (``annotations.PERSISTENT_WALK``). The order: where the steps
    depend on the K/V block (causal), K/V block first, so that every thread block starts on the
    longest tiles (the first K/V blocks) and ends on the shortest (longest-processing-time first);
    else the K/V block last, so that the tiles running at once share their heads' q and dout in L2."""
    b, hk, kb = sch.get_loops("tile")
    order = (kb, b, hk) if steps_depend_on_tile_block(sch, "q_step") else (b, hk, kb)
    sch.reorder(*order)
    step, block = sch.split(sch.fuse(*order), [None, blocks])
    sch.reorder(block, step)
    sch.bind(block, "blockIdx.x")
    sch.annotate(step, PERSISTENT_WALK, 1)


def register_intrin(name: str, desc, impl) -> None:
    """TensorIntrin.register, tolerant of a name already registered (a module reloaded)."""
    from tvm.s_tir import TensorIntrin

    try:
        TensorIntrin.register(name, desc, impl)
    except Exception:  # noqa: BLE001 - already registered
        pass


# --------------------------------------------------------------------------------------------
# row reductions over tensor-core accumulator registers
# --------------------------------------------------------------------------------------------
class QuadRowLayout:
    """How a float32 tile of n_rows x n_cols is held in registers as mma.sync m16n8 C fragments:
    mma.sync's own (sm80) or wgmma's accumulator (that fragment repeated per warp and along N).
    Each thread holds, of each 16 x 16 tile it has a part of, two rows (h = 0, 1: quad row r8
    and r8 + 8) and four elements of each (half = 0, 1: columns 8 half + 2 q + e, e = 0, 1); each
    row lives in the four lanes of one quad (lanes 4 r8 .. 4 r8 + 3 of a warp).

    key:          names the intrinsic (unique per layout and tile size).
    shape, scope: the fragment buffer an intrinsic matches.
    threads:      threads that hold the tile (threadIdx.x extent of the intrinsic).
    element(r, c): the buffer index of element (r, c) (the description; may leave out the thread
                  for per-thread "local" buffers).
    row_tiles, col_tiles: each thread holds part of row_tiles x col_tiles 16 x 16 tiles: its
                  k-th row (k = 2 rt + h, rows_per_thread = 2 row_tiles of them), per_row =
                  4 col_tiles elements of each.
    row(t, k):    the tile row of thread t's k-th row.
    row_slot(t, k): (row // 8, row % 8) of that row, spelled out so that it is plainly static per
                  thread (the index into a per-row buffer in registers, ``out_scope="local"``).
    held(t, rt, h, ct, half, e): the buffer index of element (ct, half, e) of thread t's row
                  k = 2 rt + h.
    spread_stores: how the quad writes its rows' results to shared memory. False: its first lane
                  writes them all. True: lane q writes the q-th (at most 4 rows per thread).
                  ThreadSync cannot always prove that two rows of one thread are not another
                  thread's (it cannot for the wgmma layout, and then aborts: "Cannot insert syncs
                  inside condition"); one store per thread avoids the question. But under the
                  sm80 cp.async pipeline that form fails StorageRewrite ("Buffer access occurs
                  outside a statement scope"), so sm80 keeps the first.
    """

    def __init__(self, key, shape, scope, n_rows, n_cols, threads, element, row_tiles, col_tiles, row, row_slot,
                 held, spread_stores=False):
        self.key, self.shape, self.scope = key, tuple(shape), scope
        self.n_rows, self.n_cols, self.threads = n_rows, n_cols, threads
        self.element, self.row, self.row_slot, self.held = element, row, row_slot, held
        self.row_tiles, self.col_tiles = row_tiles, col_tiles
        self.rows_per_thread, self.per_row = 2 * row_tiles, 4 * col_tiles
        self.spread_stores = spread_stores


_ROW_REDUCE_REGISTERED: set[str] = set()


def row_reduce_intrin(op: str, layout: QuadRowLayout, out_scope: str = "shared.dyn") -> str:
    """Register (once) and name a row reduction of a register tile (``layout``) into per-row
    values: ``out[r] = out[r] (op) reduce_c tile[r, c]``.

    Each thread reduces the elements it holds of each of its rows; the four lanes of a quad,
    which share those rows, then combine theirs with two xor shuffles (1, then 2).
    out_scope "shared.dyn" (or "shared", static): out is (n_rows,) in shared memory, updated by the
    first lane of the quad (or, with ``layout.spread_stores``, lane q updates the quad's q-th row).
    out_scope "local": every lane of the quad updates its own register copy of the row's value,
    so the row state is replicated on the quad, as in FA2, and no other lane ever reads it; out
    then has the layout (row // 8, row % 8) (``layout.row_slot``), so that each thread's rows
    compact to a few registers.
    """
    from tvm.script import tirx as T

    suffix = {"shared.dyn": "", "shared": "_static", "local": "_quad"}
    if out_scope not in suffix:
        raise ValueError(f"out_scope: expected 'shared.dyn', 'shared' or 'local', got {out_scope!r}")
    quad = out_scope == "local"
    name = f"tvmflash_row_{op}_{layout.key}" + suffix[out_scope]
    if name in _ROW_REDUCE_REGISTERED:
        return name
    combine = {"max": T.max, "sum": lambda a, b: a + b}[op]
    identity = {"max": T.float32("-inf"), "sum": T.float32(0)}[op]
    n_rows, n_cols, threads, shape, scope = layout.n_rows, layout.n_cols, layout.threads, layout.shape, layout.scope
    row_tiles, col_tiles, rows_per_thread = layout.row_tiles, layout.col_tiles, layout.rows_per_thread
    spread_stores = layout.spread_stores
    if spread_stores and rows_per_thread > 4:
        raise ValueError(f"row_reduce_intrin: at most 4 rows per thread (one per lane of a quad), got {rows_per_thread}")
    out_shape = (n_rows // 8, 8) if quad else (n_rows,)
    slot = (lambda r: (r // 8, r % 8)) if quad else (lambda r: (r,))  # noqa: E731 - row -> index into out
    whole = tuple(slice(0, s) for s in shape)
    out_whole = tuple(slice(0, s) for s in out_shape)

    def select(part, k):  # part[k] without a dynamic index into registers
        value = part[rows_per_thread - 1]
        for kk in range(rows_per_thread - 2, -1, -1):
            value = T.Select(k == kk, part[kk], value)
        return value

    @tvmscript.prim_func(s_tir=True)
    def desc(tile_h: T.handle, out_h: T.handle):
        tile = T.match_buffer(tile_h, shape, "float32", scope=scope, offset_factor=1)
        out = T.match_buffer(out_h, out_shape, "float32", scope=out_scope, offset_factor=1)
        with T.sblock("root"):
            T.reads(out[out_whole], tile[whole])
            T.writes(out[out_whole])
            for r, c in T.grid(n_rows, n_cols):
                with T.sblock("update"):
                    vr, vc = T.axis.remap("SR", [r, c])
                    out[slot(vr)] = combine(out[slot(vr)], tile[layout.element(vr, vc)])

    @tvmscript.prim_func(s_tir=True)
    def impl(tile_h: T.handle, out_h: T.handle):
        tile = T.match_buffer(tile_h, shape, "float32", scope=scope, offset_factor=1)
        out = T.match_buffer(out_h, out_shape, "float32", scope=out_scope, offset_factor=1)
        with T.sblock("root"):
            T.reads(out[out_whole], tile[whole])
            T.writes(out[out_whole])
            for t in T.thread_binding(threads, "threadIdx.x"):
                # (registers take static indices only: every loop over them is unrolled)
                if quad:
                    # Each lane folds its elements into its own copy of the row's value, then the
                    # quad combines the four copies: no scratch buffer (see the other branch for
                    # what one costs in a pipelined K/V step).
                    for rt in T.unroll(row_tiles):
                        for h in T.unroll(2):
                            row = T.meta_var(layout.row_slot(t, 2 * rt + h))  # this lane's copy
                            if op == "sum":  # the quad adds four copies: the old value counts once
                                out[row] = T.Select(t % 4 == 0, out[row], T.float32(0))
                            for ct in T.unroll(col_tiles):
                                for half in T.unroll(2):
                                    for e in T.unroll(2):
                                        out[row] = combine(out[row], tile[layout.held(t, rt, h, ct, half, e)])
                            for mask in T.unroll(2):  # xor 1, then xor 2: across the quad
                                out[row] = combine(out[row], T.tvm_warp_shuffle_xor(
                                    T.tvm_warp_activemask(), out[row], mask + 1, 32, 32))
                else:
                    # One statement (an attribute scope): InjectSoftwarePipeline guards each statement of
                    # the K/V step apart (static shapes), which would split part's allocation from its
                    # uses ("Buffer access occurs outside a statement scope" in StorageRewrite).
                    with T.attr(0, "tvmflash_scope", 1):
                        part = T.alloc_buffer((rows_per_thread,), "float32", scope="local")
                        for rt in T.unroll(row_tiles):
                            for h in T.unroll(2):
                                part[2 * rt + h] = identity
                                for ct in T.unroll(col_tiles):
                                    for half in T.unroll(2):
                                        for e in T.unroll(2):
                                            part[2 * rt + h] = combine(part[2 * rt + h],
                                                                       tile[layout.held(t, rt, h, ct, half, e)])
                        for k, mask in T.grid(rows_per_thread, 2):  # xor 1, then xor 2: across the quad
                            part[k] = combine(part[k], T.tvm_warp_shuffle_xor(
                                T.tvm_warp_activemask(), part[k], mask + 1, 32, 32))
                        if spread_stores:
                            # Lane q of the quad (every lane has the quad's results after the shuffles)
                            # writes the quad's q-th row: one store per thread.
                            if t % 4 < rows_per_thread:
                                out[layout.row(t, t % 4)] = combine(out[layout.row(t, t % 4)], select(part, t % 4))
                        else:  # the first lane of the quad writes all its rows
                            if t % 4 == 0:
                                for k in range(rows_per_thread):
                                    out[layout.row(t, k)] = combine(out[layout.row(t, k)], part[k])

    register_intrin(name, desc, impl)
    _ROW_REDUCE_REGISTERED.add(name)
    return name


# --------------------------------------------------------------------------------------------
# per-row values in registers, replicated on the quads that hold the rows (FA2's way)
# --------------------------------------------------------------------------------------------
def row_quad_map(i):
    """Per-row buffers kept in registers: row -> (row // 8, row % 8). Lane 4 r8 + q of a warp
    holds rows 8 k + r8 of the warp's rows: with the warp's rows starting at a multiple of 8, its
    slots are [first // 8 + k, r8], a small region once compacted, with a static index wherever
    the loops over k are unrolled."""
    return (i // 8, i % 8)


def scalars_local(sch) -> None:
    """The program's scalars in registers, each thread its copy, which per-row blocks may read
    (``quad_rows_intrin``): the scale (``init_scale``) and, with sinks, the head's sink (``init_sink``)."""
    sch.set_scope("init_scale", 0, "local")
    if has_block(sch, "init_sink"):
        sch.set_scope("init_sink", 0, "local")


def has_block(sch, name: str) -> bool:
    """Does the scheduled program hold a block named ``name`` (a variant's)?"""
    try:
        sch.get_sblock(name)
    except Exception:  # noqa: BLE001 (TVM's ScheduleError, raised as tvm's own error types)
        return False
    return True


def quad_rows_intrin(sch, block, n_rows: int, warps: int = 1) -> str:
    """Register (once) and name a TensorIntrin that runs a per-row block on the quads of
    ``warps`` warps (one of sm80, a warpgroup of sm90), DERIVED from the block itself (its
    TVMScript, re-parsed), so the schedule restates nothing.

    The block must have one spatial iterator (the row) and access only per-row "local" buffers in
    the layout ``row_quad_map`` (row // 8, row % 8), at that row (``init_ml``, ``alpha``,
    ``update_ml``, the inits of ``row_max`` and ``row_sum``), and may read scalars (local buffers
    of shape (1,), such as the scale). The description is the block over n_rows rows (those of
    ``warps`` warps, n_rows / warps each); the implementation gives the 32 * warps threads to
    threadIdx.x and has lane ``4 r8 + q`` of warp w run the block for rows
    ``(n_rows / warps) w + 8 k + r8``: the rows whose fragment elements it holds. The four lanes of
    a quad compute the same values, each into its own registers; that is how FA2 keeps m and l.
    (TensorIR cannot express this as a loop binding: a block that depends on lane // 4 only cannot
    have a 32-lane loop bound to threadIdx.x, hence an intrinsic.)
    """
    node = sch.get(block)
    if len(node.iter_vars) != 1 or int(node.iter_vars[0].iter_type) != 0:
        raise ValueError(f"quad_rows_intrin: {node.name_hint} is not a per-row block (one spatial iterator)")
    if n_rows % (8 * warps):
        raise ValueError(f"quad_rows_intrin: n_rows must be a multiple of 8 * warps, got {n_rows} and {warps} warps")
    lines = node.script().splitlines()
    iter_name = str(node.iter_vars[0].var.name)
    decl = re.compile(r"^    (\w+) = T\.Buffer\(\((\d+), 8\)(.*)\)$")  # row_quad_map's layout
    scalar_decl = re.compile(r"^    (\w+) = T\.Buffer\(\(1,\)(.*)\)$")
    buffers, scalars, accesses, body = {}, {}, [], []
    for line in lines[1:]:
        if line.startswith(f"    {iter_name} = T.axis.spatial("):
            continue
        if (hit := decl.match(line)) is not None:
            name, _, rest = hit.groups()
            rest = rest.replace(", layout=None", "")
            if 'scope="local"' not in rest and 'scope="shared.dyn"' not in rest:
                raise ValueError(f"quad_rows_intrin: {node.name_hint} accesses {name}, not a local or shared per-row buffer")
            buffers[name] = rest
        elif (hit := scalar_decl.match(line)) is not None:
            name, rest = hit.groups()
            if 'scope="local"' not in rest:
                raise ValueError(f"quad_rows_intrin: {node.name_hint} reads {name}, not a local scalar")
            scalars[name] = rest.replace(", layout=None", "")
        elif re.match(r"^    \w+ = T\.Buffer\(", line):  # a buffer of another shape: not a per-row block
            raise ValueError(f"quad_rows_intrin: {node.name_hint} accesses a buffer that is neither per-row "
                             f"(n, 8) nor a scalar: {line.strip()}")
        elif line.startswith("    T.reads(") or line.startswith("    T.writes("):
            accesses.append(line[4:])
        elif line.startswith("    T.") and not line.startswith("    T.Cast") and "] = " not in line:
            raise ValueError(f"quad_rows_intrin: unexpected line in {node.name_hint}: {line.strip()}")
        else:
            body.append(line[4:])
    if not buffers or not body:
        raise ValueError(f"quad_rows_intrin: nothing to derive from {node.name_hint}")
    # The outer block that tensorize makes reads and writes what the block declares (an init from
    # decompose_reduction declares no reads), so the description's root does the same.
    declared = {kind: [b for b in buffers if any(line.startswith(f"T.{kind}(") and re.search(rf"\b{b}\[", line)
                                                for line in accesses)] for kind in ("reads", "writes")}
    read, written = declared["reads"], declared["writes"]
    shared = [b for b, rest in buffers.items() if 'scope="local"' not in rest]
    if any(b in read for b in shared):
        raise ValueError(f"quad_rows_intrin: {node.name_hint} reads a shared buffer; only local per-row values can be read")
    if any(re.search(rf"\b{b}\[", line) for b in scalars for line in accesses if line.startswith("T.writes(")):
        raise ValueError(f"quad_rows_intrin: {node.name_hint} writes a scalar; scalars can only be read")
    whole = lambda names: ", ".join([f"{b}[0:{n_rows // 8}, 0:8]" for b in names]  # noqa: E731
                                    + ([f"{b}[0:1]" for b in scalars] if names is read else []))
    params = ", ".join(f"{b}_h: T.handle" for b in [*buffers, *scalars])
    matches = "\n".join([f"    {b} = T.match_buffer({b}_h, ({n_rows // 8}, 8){rest}, offset_factor=1)"
                          for b, rest in buffers.items()]
                         + [f"    {b} = T.match_buffer({b}_h, (1,){rest}, offset_factor=1)" for b, rest in scalars.items()])
    head = (f"@T.prim_func(s_tir=True)\ndef {{fn}}({params}):\n{matches}\n"
            f'    with T.sblock("root"):\n        T.reads({whole(read)})\n        T.writes({whole(written)})\n')
    ind = lambda text, n: "\n".join(" " * n + t for t in text)  # noqa: E731
    desc = (head.format(fn="desc")
            + f"        for r in range({n_rows}):\n"
            + f'            with T.sblock("{node.name_hint}"):\n'
            + f"                {iter_name} = T.axis.spatial({n_rows}, r)\n"
            + ind(accesses + body, 16) + "\n")
    per_warp = n_rows // warps
    warp_rows = f"{per_warp} * (lane // 32) + " if warps > 1 else ""
    impl = (head.format(fn="impl")
            + f'        for lane in T.thread_binding({32 * warps}, "threadIdx.x"):\n'
            + f"            for k in T.unroll({per_warp // 8}):\n"
            + f"                {iter_name} = T.meta_var({warp_rows}8 * k + lane % 32 // 4)\n"
            # A shared per-row buffer (a staging copy) is written by the quad's first lane only.
            + (ind(["if lane % 4 == 0:"] + ["    " + line for line in body], 16) if shared else ind(body, 16))
            + "\n")
    name = f"tvmflash_quad_rows_{node.name_hint}_{hashlib.sha1(desc.encode()).hexdigest()[:10]}"
    if name not in _QUAD_ROWS_REGISTERED:
        register_intrin(name, tvmscript.from_source(desc), tvmscript.from_source(impl))
        _QUAD_ROWS_REGISTERED.add(name)
    return name


_QUAD_ROWS_REGISTERED: set[str] = set()


def quad_row_block(sch, name, groups: int, warps: int = 1) -> None:
    """Per-row block on the quads: rows split over ``groups`` (threadIdx.y: warps or
    warpgroups), each group's rows tensorized with the intrinsic derived from the block
    (``quad_rows_intrin``): every lane of a quad computes its rows. name: a block name or a block."""
    block = sch.get_sblock(name) if isinstance(name, str) else name
    i = sch.fuse(*sch.get_loops(block))
    g, r = sch.split(i, [groups, None])
    sch.bind(g, "threadIdx.y")
    sch.tensorize(r, quad_rows_intrin(sch, block, sch.get(r).extent.value, warps))


def quad_row_init(sch, warps: int = 1):
    """``tensorize_row_reduce``'s schedule_init for per-row values on the quads: the per-row init of
    a row reduction runs on the quads that hold the rows (``quad_rows_intrin``)."""
    def schedule_init(init, update):
        rows = sch.get_loops(init)[-1]
        sch.tensorize(rows, quad_rows_intrin(sch, init, sch.get(rows).extent.value, warps))
    return schedule_init


def staged_row_block(sch, name, groups: int, row_block, warps: int = 1) -> None:
    """Per-row block, one lane per row (``row_block(sch, name)``), that reads per-row values held
    on the quads, after the K/V loop (store_lse). Lane j cannot read row j from its own registers
    (its quad holds rows 8 k + j // 4), and a lane-dependent choice among a thread's values is a
    dynamically indexed array, which nvcc keeps in local memory. So the values go through shared
    memory once, after the loop: a copy block per buffer (reindex), run on the quads with static
    indices (the first lane of each quad writes), then the block reads the copies one lane per
    row. This costs one __syncthreads after the K/V loop, none inside it."""
    block = sch.get_sblock(name)
    for source in [region.source.name for region in sch.get(block).reads if region.source.scope() == "local"]:
        index = [region.source.name for region in sch.get(block).reads].index(source)
        # (cache_read wants a buffer with one writer; reindex does not, and its copy block has the
        # block's own row iterator)
        staged = sch.reindex(block, ("read", index))
        sch.set_scope(staged, 0, "shared.dyn")
        sch.transform_layout(staged, ("write", 0), row_quad_map)
        quad_row_block(sch, staged, groups, warps)
    row_block(sch, name)


def hide_init_reads(sch: tvm.s_tir.Schedule, block) -> None:
    """decompose_reduction leaves the init's reads (alpha for pv's rescale, m for row_max) on
    the update block; drop those its body does not load, so the update matches its intrinsic,
    which reads only the operands and the value it updates."""
    update = sch.get(block)
    loaded = _loaded_buffers(update.body)
    extra = [k for k, region in enumerate(update.reads)
             if not any(region.source.same_as(buf) for buf in loaded)]
    if extra:
        sch.unsafe_hide_buffer_access(block, "read", extra)


def tensorize_row_reduce(sch: tvm.s_tir.Schedule, name: str, intrin: str, groups: int, lanes: int,
                         schedule_init=None) -> None:
    """A row reduction block (rows, cols) over register tiles: rows split over ``groups``
    (threadIdx.y: warps or warpgroups), the init becomes a per-row block ``<name>_init``, and each
    group's rows are tensorized with ``intrin``. The init runs row r of a group on thread r of
    ``lanes``, unless ``schedule_init(init, update)`` schedules it (it runs before the update's
    init reads are hidden)."""
    i = sch.get_loops(name)[-2]
    g, r = sch.split(i, [groups, None])
    sch.bind(g, "threadIdx.y")
    init = sch.decompose_reduction(name, r)
    update = sch.get_sblock(f"{name}_update")
    if schedule_init is None:
        _, lane = sch.split(sch.get_loops(init)[-1], [None, lanes])
        sch.bind(lane, "threadIdx.x")
    else:
        schedule_init(init, update)
    hide_init_reads(sch, update)
    sch.tensorize(r, intrin)


def _loaded_buffers(node) -> list:
    """The buffers a statement or expression loads from (enough of a walk for a block body)."""
    if type(node).__name__ in ("TensorLoad", "BufferLoad"):  # 0.27 names it TensorLoad
        return [node.source] + [b for i in node.indices for b in _loaded_buffers(i)]
    found = []
    for attr in ("value", "a", "b", "condition", "true_value", "false_value", "body", "block", "seq", "args",
                 "indices"):
        child = getattr(node, attr, None)
        if child is None or isinstance(child, (int, float, str)):
            continue
        for c in (child if isinstance(child, (list, tuple)) or hasattr(child, "__len__") else [child]):
            if isinstance(c, tvm.runtime.Object):
                found += _loaded_buffers(c)
    return found


def pipeline_loads(sch, num_stages, lagged=(), step="kv_step", loads=("load_k", "load_v"), async_loads=True,
                   ahead=()):
    """Software-pipeline the loop of a tile's steps (the forward's K/V tiles: ``step`` kv_step, whose
    ``loads`` are load_k and load_v; the backward's dkdv streams Q blocks: q_step, load_q and
    load_do): the loads are stage 0, as cp.async copies
    (``tirx.use_async_copy``; a row past seqlen_k is predicated off and zeroed by st.shared), and
    everything else is stage num_stages - 1. TVM's InjectSoftwarePipeline then keeps num_stages
    versions of Kt and Vt (they are allocated in kv_step's scope for this), issues the copies of
    tile kb + num_stages - 1 before the compute of tile kb, and waits with cp.async.wait_group.

    lagged (sm90's overlap, FA3's intra-warpgroup order): blocks (a tensorized GEMM: its statements
    follow its ``<name>_init`` block) that run one stage after the rest and first after the loads:
    the rest takes stage num_stages - 2, so the step of tile kb runs them for tile kb - 1 before the
    rest for tile kb (PV of the previous tile is issued before this tile's QK^T). V then needs
    num_stages versions and K one fewer.

    async_loads=False: the loads are plain (into registers, say), not cp.async: stage 0 is no async stage,
    and the step of tile kb issues the loads of tile kb + num_stages - 1 before its compute waits for them.
    ahead: blocks of the later stage that the step runs before the loads (in the program they may come
    between them: they read what the loads wrote), so that the loads of the next tile overwrite a buffer
    they have read: one version of it (registers indexed by constants, not a stack array by the step's
    parity).
    """
    kb = sch.get_loops(step)[-1]
    stmts = _pipeline_stmts(sch, kb)
    names = [_sblock_names(stmt) for stmt in stmts]
    for i in range(1, len(names)):  # a tensorized GEMM's statements carry no name: its init's, less "_init"
        if not names[i]:
            names[i] = {name.removesuffix("_init") for name in names[i - 1]}
    rest = num_stages - 2 if lagged else num_stages - 1
    stages = [0 if name & set(loads) else rest + 1 if name & set(lagged) else rest for name in names]
    if (stages[: len(loads)] != [0] * len(loads) and not ahead) or sum(bool(name & set(loads)) for name in names) != len(loads):
        raise RuntimeError(f"pipeline: expected {loads} first in {step} (anywhere with ahead), one statement each; "
                           f"got {names}")
    late = [i for i, name in enumerate(names) if name & set(lagged)]
    if lagged and not late:
        raise RuntimeError(f"pipeline: expected {lagged} in {step}; got {names}")
    first = [i for i, name in enumerate(names) if name & set(ahead)]
    if len(first) != len(ahead):
        raise RuntimeError(f"pipeline: expected {ahead} in {step}, one statement each; got {names}")
    issued = [i for i, name in enumerate(names) if name & set(loads)]
    body = first + issued + late + [i for i in range(len(stmts)) if i not in late and i not in first and i not in issued]
    sch.annotate(kb, "software_pipeline_stage", stages)
    sch.annotate(kb, "software_pipeline_order", [body.index(i) for i in range(len(stmts))])
    if async_loads:
        sch.annotate(kb, "software_pipeline_async_stages", [0])


def _pipeline_stmts(sch, kb):
    """The statements InjectSoftwarePipeline will see in the K/V-tile loop: the passes before it
    (LiftThreadBinding, LowerMatchBuffer, StmtSimplify) reshape kv_step's body, so run them on a
    copy (the same list as tvm.s_tir.pipeline's) and look."""
    from tvm import s_tir
    from tvm.s_tir import SBlockRealize
    from tvm.tirx import For, IntImm, SeqStmt

    marker = "tvmflash_pipelined_loop"
    sch.annotate(kb, marker, 1)
    sch.annotate(kb, "software_pipeline_stage", [0])  # LiftThreadBinding treats pipelined loops apart
    mod = tvm.transform.Sequential([
        s_tir.transform.CanonicalizeLoop(), s_tir.transform.LowerCrossThreadReduction(),
        s_tir.transform.LowerInitBlock(), s_tir.transform.PlanAndUpdateBufferAllocationLocation(),
        s_tir.transform.ConvertBlocksToOpaque(), s_tir.transform.LiftThreadBinding(),
        s_tir.transform.ManifestSharedMemoryLocalStage(), s_tir.transform.CompactBufferAllocation(),
        s_tir.transform.LowerAutoCopy(), s_tir.transform.UnifyThreadBinding(),
        s_tir.transform.LowerMatchBuffer(), s_tir.transform.StmtSimplify(),
    ])(sch.mod)
    sch.unannotate(kb, marker)
    sch.unannotate(kb, "software_pipeline_stage")

    def find(stmt):  # the marked loop: under blocks, loops, attributes and sequences only
        if isinstance(stmt, For) and marker in stmt.annotations:
            return stmt
        children = list(stmt.seq) if isinstance(stmt, SeqStmt) else [
            getattr(stmt, attr) for attr in ("block", "body") if hasattr(stmt, attr)]
        for child in children:
            if (hit := find(child)) is not None:
                return hit
        return None

    body = find(mod[sch.func_working_on or "main"].body).body  # the function scheduled (decode's "split")
    while not isinstance(body, SeqStmt):  # the kv_step block (now opaque) and its realize
        body = body.block if hasattr(body, "block") else body.body
    stmts = []
    for stmt in body.seq:  # the pass opens a nested unpredicated block whose body is a sequence
        if (isinstance(stmt, SBlockRealize) and isinstance(stmt.predicate, IntImm) and stmt.predicate.value == 1
                and isinstance(stmt.block.body, SeqStmt)):
            stmts.extend(stmt.block.body.seq)
        else:
            stmts.append(stmt)
    return stmts


def _sblock_names(stmt):
    """Names of the sblocks in a statement (enough of a walk for kv_step's children)."""
    from tvm.tirx import For, SeqStmt
    from tvm.s_tir import SBlock, SBlockRealize

    if isinstance(stmt, SeqStmt):
        return set().union(*(_sblock_names(s) for s in stmt.seq))
    if isinstance(stmt, For):
        return _sblock_names(stmt.body)
    if isinstance(stmt, SBlockRealize):
        return _sblock_names(stmt.block)
    if isinstance(stmt, SBlock):
        return {str(stmt.name_hint)} | _sblock_names(stmt.body)
    return set()


def read_index(sch, block, name: str) -> int:
    """The index, among a block's reads, of the program's buffer ``name`` (set_scope and cache_read
    append scopes to the name: Kt_shared.dyn, l_keys_local)."""
    block = sch.get_sblock(block) if isinstance(block, str) else block
    names = [str(region.source.name) for region in sch.get(block).reads]
    for scope in ("_shared.dyn", "_shared", "_local"):
        names = [n.removesuffix(scope) for n in names]
    return names.index(name)
