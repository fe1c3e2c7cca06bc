"""The ``tvmflash`` command: info, compile, bench, tune, cache."""

from __future__ import annotations

import argparse
import functools
import json
import logging
import os
import sys


def _info(args) -> int:
    import torch
    import tvm

    import tvmflash
    from tvmflash import cache, choice, target

    resolved = target.resolve(None)
    print(f"tvmflash {tvmflash.__version__}, TVM {tvm.__version__}, torch {torch.__version__}")
    if torch.cuda.is_available():
        major, minor = torch.cuda.get_device_capability()
        print(f"GPU: {torch.cuda.get_device_name()} (compute capability {major}.{minor})")
    else:
        print("GPU: none visible to torch")
    # the forward's schedule at head_dim 128, as compile chooses it (another head_dim may take another)
    names = {choice.choose_schedule("forward", resolved, {"head_dim": 128, "dtype": dtype, "causal": False})[0].name
             for dtype in ("bfloat16", "float32")}
    print(f"default target: {target.describe(resolved)} -> schedules {', '.join(sorted(names))}")
    print(f"cache dir: {cache.cache_dir()}")
    _print_modules(cache.list_modules())
    return 0


def _print_modules(entries) -> None:
    print(f"cached modules: {len(entries)}")
    for e in entries:
        if "problem" in e:  # rebuilt when next used
            print(f"  {e['key']}  unusable: {e['problem']}  {e['bytes'] // 1024} KiB")
            continue
        spec = e.get("spec", {})
        target = json.loads(e["target"]) if str(e.get("target", "")).startswith("{") else {}
        kind = f"{target.get('kind', '?')} {target.get('arch') or target.get('mcpu') or ''}".strip()
        variant = "".join(f" {name}={spec[name]}" for name, off in (("window_left", -1), ("window_right", -1),
                                                                     ("softcap", 0.0), ("alibi", False),
                                                                     ("dropout", False), ("leftpad", False),
                                                                     ("sinks", False))
                          if spec.get(name, off) != off)
        flex = spec.get("flex")  # a score_mod's and mask_mod's trees: named by which are there
        if flex:
            variant += " flex=" + "+".join(name for name in ("score", "mask") if flex.get(name))
        # what tells modules of one spec apart: the pass, the target, the knobs, the code they were built from
        print(f"  {e.get('key')}  {e.get('schedule')} {e.get('pass', 'forward')}  d{spec.get('head_dim')} {spec.get('dtype')} "
              f"{'causal' if spec.get('causal') else 'full'}{variant} hq{spec.get('heads_q')}/hkv{spec.get('heads_kv')}  "
              f"{kind}{' (CUDA source)' if e['path'].endswith('.cu') else ''}  {json.dumps(e.get('knobs'), sort_keys=True)}  "
              f"code {str(e.get('code', '?'))[:8]}  {e['bytes'] // 1024} KiB  {e.get('created', '')}")


def _compile(args) -> int:
    import tvmflash
    from tvmflash import target

    (causal,) = CAUSAL[args.causal]
    kernel = tvmflash.compile(head_dim=args.head_dim, dtype=args.dtype, causal=causal, target=args.target,
                              knobs=json.loads(args.knobs) if args.knobs else None)
    heads_kv = args.heads_kv or args.heads_q
    emit = args.emit or ("cuda" if target.is_cuda(kernel.target) else "tir")
    if emit == "cuda":
        text = kernel.source(args.heads_q, heads_kv)
    else:  # "tir": the scheduled TensorIR, before lowering
        text = kernel.scheduled_tir(args.heads_q, heads_kv)
    if args.output in (None, "-"):
        sys.stdout.write(text)
    else:
        with open(args.output, "w") as f:
            f.write(text)
        print(f"wrote {args.output} ({len(text)} bytes): {kernel!r}", file=sys.stderr)
    return 0


def _bench(args) -> int:
    from tvmflash import bench, plot

    # every output is checked before the run, which can take many minutes, rather than after it
    if args.plot:
        _writable(args.plot, "--plot")
        plot.check(args.plot)
    if args.json:
        _writable(args.json, "--json")
    if args.from_json:
        report = bench.load_report(args.from_json)
        bench.print_report(report)
    else:
        report = bench.run(device=args.device, dtype=args.dtype, head_dims=args.head_dim,
                           causal=CAUSAL[args.causal],
                           seqlens=args.seqlens, tokens=args.tokens, hidden=args.hidden, repeat=args.repeat,
                           target=args.target, knobs=json.loads(args.knobs) if args.knobs else None,
                           layout=args.layout)
    print("ratios are the backend's time over tvmflash's: above 1.00x, tvmflash is faster")
    if args.json:
        bench.save_report(report, args.json)  # before the figure: a failed plot loses no measurement
        print(f"wrote {args.json}")
    if args.plot:
        plot.plot(report, args.plot)
        print(f"wrote {args.plot}")
    failed = [r.config for r in report.results if r.error > r.tolerance]
    if failed:
        print(f"ERROR: {len(failed)} configurations exceeded the error tolerance: {failed}", file=sys.stderr)
        return 1
    return 0


def _writable(path: str, option: str) -> None:
    """ValueError unless ``path`` names a file that can be written (its folder exists and is writable)."""
    folder = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(path):
        raise ValueError(f"{option}: {path} is a folder, expected a file name")
    if not os.path.isdir(folder):
        raise ValueError(f"{option}: cannot write {path}: {folder} is not a folder")
    if not os.access(folder, os.W_OK) or (os.path.exists(path) and not os.access(path, os.W_OK)):
        raise ValueError(f"{option}: cannot write {path}: permission denied")


def _workload_dir(work_dir, name: str, count: int):
    """--work-dir as given for one workload; a subfolder per workload for several."""
    if work_dir is None or count == 1:
        return work_dir
    return os.path.join(work_dir, name.replace(" ", "-"))


def _tune(args) -> int:
    from tvmflash import database, program, tune

    if args.all:
        workloads = shipped_workloads()
        if not workloads:
            raise ValueError(f"--all: no shipped tuning records in {database.SHIPPED_DIR}")
    elif not args.head_dim:
        raise ValueError("tune: give --head-dim (one or more), or --all for every shipped workload")
    else:
        workloads = [(head_dim, dtype, causal, args.pass_, args.page_size, args.cache_dtype) for head_dim in args.head_dim
                     for dtype in args.dtype
                     for causal in CAUSAL[args.causal]]
    if args.trials < 1:
        raise ValueError(f"trials: expected a positive number, got {args.trials}")
    flex = None
    if args.block_mask and not args.flex:
        raise ValueError("--block-mask: a BlockMask of a --flex pattern's mask_mod; give --flex")
    if args.flex:
        from tvmflash.flex_patterns import TuningCase

        if args.all or args.pass_ == "decode" or args.causal != "no" or FP8 in args.dtype:
            raise ValueError("--flex: the forward's or backward's knobs of one pattern (its mask is its mask_mod): not "
                             f"with --all, --pass decode, --causal or --dtype {FP8}")
        flex = TuningCase(args.flex, args.block_mask)
    for head_dim, dtype, causal, pass_, page_size, cache_dtype in workloads:  # all valid before the first runs
        program.AttentionSpec(head_dim, dtype, causal)
        if pass_ != "decode" and page_size:
            raise ValueError("--page-size: a cache layout, for --pass decode only")
        if pass_ != "decode" and cache_dtype:
            raise ValueError("--cache-dtype: the KV cache's dtype, for --pass decode only (q's is --dtype)")
        if dtype == FP8 and pass_ != "forward":
            raise ValueError(f"--dtype {FP8}: the FP8 forward's inputs (it has no backward); decode over an FP8 "
                             f"cache is --pass decode --cache-dtype {FP8}, with q's --dtype")
    records, failed = [], []
    # A progress bar on a terminal; plain lines in a log or a pipe.
    bar_stream = sys.stdout if sys.stdout.isatty() else None
    echo = functools.partial(print, flush=True)
    for n, (head_dim, dtype, causal, pass_, page_size, cache_dtype) in enumerate(workloads, 1):
        name = (f"d{head_dim} {dtype} {'causal' if causal else 'full'}" + ("" if pass_ == "forward" else f" {pass_}")
                + (f" paged {page_size}" if page_size else "") + (f" {cache_dtype} cache" if cache_dtype else "")
                + (f" {flex}" if flex else ""))
        if len(workloads) > 1:
            print(f"== workload {n}/{len(workloads)}: {name}", flush=True)
        shape = {"batch": args.batch, "seqlen": args.seqlen, "heads": args.heads}
        try:
            if flex is not None:  # measured, as the backward is (``tune.measured.FlexForward``)
                record = tune.tune_pass("flex" if pass_ == "forward" else "flex-backward", head_dim=head_dim,
                                        dtype=dtype, target=args.target, trials=args.trials, cold=args.cold, flex=flex,
                                        echo=echo, **shape)
            elif pass_ != "forward":
                record = tune.tune_pass(pass_, head_dim=head_dim, dtype=dtype, causal=causal, target=args.target,
                                        trials=args.trials, page_size=page_size, cache_dtype=cache_dtype,
                                        cold=args.cold, echo=echo, **shape)
            elif dtype == FP8:  # the FP8 forward: a small knob set of its own, measured whole
                record = tune.tune_pass("fp8", head_dim=head_dim, dtype=dtype, causal=causal, target=args.target,
                                        trials=args.trials, cold=args.cold, echo=echo, **shape)
            else:
                record = tune.tune(head_dim=head_dim, dtype=dtype, causal=causal, target=args.target,
                                   trials=args.trials, work_dir=_workload_dir(args.work_dir, name, len(workloads)),
                                   cold=args.cold, echo=echo, bar_stream=bar_stream, **shape)
        except RuntimeError as err:  # nothing built and ran: say so, go on with the others
            print(f"tvmflash tune: {name}: {err}", file=sys.stderr)
            failed.append(name)
            continue
        records.append((name, record))
    print(summary_table(records))
    return 1 if failed else 0


def shipped_workloads() -> list[tuple[int, str, bool, str, int, str | None]]:
    """(head_dim, dtype, causal, pass, page_size, cache_dtype) of every workload with a shipped record
    (``tuning_logs/``), sorted: what ``tvmflash tune --all`` re-tunes for this GPU (the FP8 forward's: dtype
    float8_e4m3fn; decode over an FP8 cache: cache_dtype float8_e4m3fn, else None)."""
    from tvmflash import database

    found = set()
    for path in sorted(database.SHIPPED_DIR.glob("*.json")):
        for record in database.read(path):
            workload = record["workload"]
            if "flex" in workload:  # a flex pattern's: its mods are not in the record (tune it with --flex)
                continue
            found.add((workload["head_dim"], workload["dtype"], workload["causal"], workload.get("pass", "forward"),
                       workload.get("page_size", 0), workload.get("cache_dtype")))
    return sorted(found, key=lambda w: (*w[:5], w[5] or ""))


def summary_table(records: list[tuple[str, dict]]) -> str:
    """The tuning summary, a row per workload: trials and the failed share, the search's best and
    the kept record's time, the defaults' time and the speedup over them (all through
    tvmflash.compile at the tuning shape, in the same run), the wall time and the knobs kept."""
    width = max([24] + [len(name) for name, _ in records])
    header = (f"{'workload':<{width}} {'start':<5} {'trials':>6} {'failed':>6} {'search ms':>10} {'kept ms':>10} "
              f"{'default ms':>10} {'speedup':>7} {'wall s':>7}  knobs kept")
    rows = [f"{name:<{width}} {r['start']:<5} {r['trials']:>6} {r['failed_trials'] / max(1, r['trials']):>6.0%} "
            f"{r['tuned_ms']:>10.4f} {r['mean_ms']:>10.4f} {r['default_ms']:>10.4f} "
            f"{r['default_ms'] / r['mean_ms']:>6.2f}x {r['wall_s']:>7.0f}  {json.dumps(r['knobs'])}"
            for name, r in records]
    return "\n".join(["== summary (speedup: the defaults' time over the kept one's)", header, *rows]
                     if rows else ["== summary: no workload finished"])


def _cache(args) -> int:
    """ls, show KEY, clear, export: the disk cache's modules and the tuning records."""
    import shutil

    from tvmflash import cache, database

    records = database.all_records()
    if args.action == "ls":
        print(f"cache dir: {cache.cache_dir()}")
        _print_modules(cache.list_modules())
        print(f"tuning records: {len(records)} (user: {database.user_dir()}, shipped: {database.SHIPPED_DIR})")
        for path, r in records:
            w = r.get("workload", {})
            at = f" at s{r['shape'].get('seqlen_k')}" if isinstance(r.get("shape"), dict) else ""  # its seqlen bucket's
            print(f"  {database.record_id(r)}  {'shipped' if path.parent == database.SHIPPED_DIR else 'user'}  "
                  f"{r.get('device')}  {r.get('schedule')}  d{w.get('head_dim')} {w.get('dtype')} "
                  f"{'causal' if w.get('causal') else 'full'}{' ' + w['pass'] if 'pass' in w else ''}"
                  f"{' ' + str(w['cache_dtype']) + ' cache' if 'cache_dtype' in w else ''}"
                  f"{' ' + r.get('flex_case', 'flex') + ' ' + w['flex'][:8] if 'flex' in w else ''}  "
                  f"{r.get('mean_ms', float('nan')):.4f} ms{at}  "
                  f"{json.dumps(r.get('knobs'))}  {r.get('created', '')}")
    elif args.action == "show":
        if not args.key:
            raise ValueError("KEY: `tvmflash cache show` needs a module key or record id (see `tvmflash cache ls`)")
        found = [e for e in cache.list_modules() if str(e.get("key", "")).startswith(args.key)]
        found += [{**r, "id": database.record_id(r), "file": str(path)} for path, r in records
                  if database.record_id(r).startswith(args.key)]
        if len(found) != 1:
            raise ValueError(f"KEY: {args.key!r} matches {len(found)} modules and tuning records, expected one "
                             f"(see `tvmflash cache ls`)")
        print(json.dumps(found[0], indent=1, sort_keys=True))
    elif args.action == "clear":
        doomed = [cache.module_dir(), database.user_dir(), cache.cache_dir() / "tuning-work"]
        modules = len(cache.list_modules())
        user_records = sum(1 for path, _ in records if path.parent == database.user_dir())
        print(f"deleting {modules} cached modules ({cache.module_dir()}), {user_records} tuning records "
              f"({database.user_dir()}) and tuning work dirs ({doomed[2]}); shipped records stay")
        for folder in doomed:
            shutil.rmtree(folder, ignore_errors=True)
    else:  # export
        written = database.export_best(args.out)
        print(f"exported the best records of {len(written)} files: " + (", ".join(map(str, written)) or "none"))
    return 0


# tvmflash.flex_patterns.PATTERNS's names (written out: the parser imports no torch; tests/test_cli checks them)
FLEX_PATTERNS = ("causal", "sliding-window", "document", "prefix-lm", "alibi", "softcap", "relative-bias")

# The FP8 (e4m3) dtype (tvmflash.program.FP8, written out: the parser imports no torch; tests/test_cli checks it):
# the FP8 forward's inputs (tune --dtype), an FP8 KV cache's (tune --pass decode --cache-dtype).
FP8 = "float8_e4m3fn"

# --causal's values: the causal settings each means.
CAUSAL = {"no": (False,), "yes": (True,), "both": (False, True)}


def add_causal(command: argparse.ArgumentParser, default: str, text: str, both: bool = True) -> None:
    """--causal, taken in the same forms by every command: alone it means yes; or yes, no and, where
    the command runs several configurations, both. (bench's took a value only, tune's and compile's
    none or none at all: `bench --causal` and `tune --causal yes` were errors.)"""
    command.add_argument("--causal", nargs="?", const="yes", default=default,
                         choices=list(CAUSAL) if both else ["no", "yes"], help=f"{text}; --causal alone means yes")


class _HelpWithDefaults(argparse.HelpFormatter):
    """Each option's help ends with its default, where it has one (None's meaning is in the help)."""

    def _get_help_string(self, action):
        text = action.help or ""
        if action.option_strings and action.default not in (None, argparse.SUPPRESS) and not action.required:
            default = " ".join(map(str, action.default)) if isinstance(action.default, list) else action.default
            text += f" (default: {default})"
        return text


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="tvmflash", description="FlashAttention from one TVM TensorIR program")
    sub = p.add_subparsers(dest="command", required=True)

    def command(name, text):
        return sub.add_parser(name, help=text, description=text, formatter_class=_HelpWithDefaults)

    command("info", "TVM version, detected GPU and target, cache dir and contents")

    dtypes = ["float16", "bfloat16", "float32"]
    c = command("compile", "build a kernel and write its CUDA source (or scheduled TensorIR)")
    c.add_argument("--target", default=None, help="cpu, cuda, sm80, sm86, sm89, sm90, sm100 or sm120; none given: this machine's")
    c.add_argument("--head-dim", type=int, required=True, help="a multiple of 8 up to 256 that the target's schedules serve")
    c.add_argument("--dtype", default="bfloat16", choices=dtypes, help="the inputs' dtype")
    add_causal(c, "no", "the bottom-right aligned causal mask", both=False)
    c.add_argument("--heads-q", type=int, default=16, help="query heads (a module is built per head count)")
    c.add_argument("--heads-kv", type=int, default=None, help="key/value heads; none given: --heads-q")
    c.add_argument("--knobs", default=None, help='schedule knobs as JSON, e.g. \'{"block_m": 64}\'')
    c.add_argument("--emit", default=None, choices=["cuda", "tir"],
                   help="the CUDA source or the scheduled TensorIR; none given: cuda for a CUDA target, else tir")
    c.add_argument("-o", "--output", default=None, help="the file to write; none given: standard output")

    b = command("bench", "time tvmflash against torch SDPA on the same inputs")
    b.add_argument("--device", default=None, help="cpu or cuda; none given: cuda if torch sees a GPU")
    b.add_argument("--dtype", default="bfloat16", choices=dtypes, help="the inputs' dtype")
    b.add_argument("--head-dim", type=int, nargs="+", default=[64, 128], help="one or more")
    add_causal(b, "both", "both: each configuration twice")
    b.add_argument("--seqlens", type=int, nargs="+", default=None,
                   help="none given: 512 to 16384 on a GPU, 256 to 2048 on a CPU")
    b.add_argument("--tokens", type=int, default=None, help="batch * seqlen; none given: 16384 on a GPU, 2048 on a CPU")
    b.add_argument("--hidden", type=int, default=None,
                   help="heads * head_dim; none given: 2048 on a GPU, 512 on a CPU")
    b.add_argument("--repeat", type=int, default=20, help="timed calls a backend and round")
    b.add_argument("--target", default=None, help="as compile's; none given: the device's")
    b.add_argument("--knobs", default=None, help="schedule knobs as JSON; none given: tuned or default ones")
    b.add_argument("--layout", default="bshd", choices=["bshd", "bhsd"],
                   help="bhsd: the inputs are (b, h, s, d) tensors, SDPA's layout, and tvmflash is timed on "
                        "transpose(1, 2) views of them (strided, no copy) and on contiguous copies, in one run")
    b.add_argument("--json", default=None, metavar="FILE",
                   help="also write what was measured (results, ceilings, device, date, commit) to FILE as JSON")
    b.add_argument("--plot", default=None, metavar="FILE",
                   help="draw TFLOP/s against the sequence length to FILE (.png, .svg or .pdf): a panel per head_dim "
                        "and mask, a line per backend and the matmul ceiling measured in the run; needs matplotlib "
                        "(pip install 'tvmflash[plot]')")
    b.add_argument("--from-json", default=None, metavar="FILE",
                   help="measure nothing: print (and with --plot draw) a report that --json wrote, e.g. one "
                        "written on a GPU machine without matplotlib; the options that shape a run are then ignored")

    t = command("tune", "tune the schedule's knobs on this machine (MetaSchedule); store the best")
    t.add_argument("--head-dim", type=int, nargs="+", default=None, help="one or more; each is a workload")
    t.add_argument("--all", action="store_true",
                   help="re-tune every workload that has a shipped record (tuning_logs/) for this GPU, "
                        "instead of --head-dim/--dtype/--causal")
    t.add_argument("--dtype", nargs="+", default=["bfloat16"], choices=[*dtypes, FP8],
                   help=f"one or more; {FP8}: the FP8 (e4m3) forward of flash_attn_func(q_descale=, ...), on sm90 "
                        "GPUs (H100, H200) alone, its small space measured as --pass backward's is; its records are "
                        "read by the FP8 forward alone. With --pass decode, q's dtype (an FP8 cache: --cache-dtype)")
    add_causal(t, "no", "both: each workload with and without")
    t.add_argument("--pass", dest="pass_", choices=["forward", "backward", "decode"], default="forward",
                   help="the forward's knobs (MetaSchedule's search; the FP8 forward's, --dtype float8_e4m3fn, "
                        "measured), or the backward's or decode's (their space measured: the known configurations, "
                        "then a random draw; decode over an FP8 cache: --cache-dtype)")
    t.add_argument("--flex", default=None, choices=list(FLEX_PATTERNS),
                   help="tune the forward (with --pass backward: the backward) of a FlexAttention pattern "
                        "(tvmflash.flex_patterns: its score_mod or mask_mod compiled in) by measuring its space, as "
                        "--pass backward does; the record is keyed by the mods' trace, which every flex_attention call "
                        "of the same mods then reads")
    t.add_argument("--block-mask", action="store_true",
                   help="--flex: with the pattern's BlockMask (create_block_mask, BLOCK_SIZE 128): the block-sparse "
                        "kernel's knobs")
    t.add_argument("--page-size", type=int, default=0,
                   help="--pass decode: tune for a paged KV cache of pages this many rows (0: contiguous)")
    t.add_argument("--cache-dtype", default=None, choices=[FP8],
                   help=f"--pass decode: tune decode over a KV cache of this dtype ({FP8}: "
                        "flash_attn_with_kvcache(k_descale=, v_descale=) over an FP8 cache; q in --dtype, bfloat16 or "
                        "float16); its records are read by decode over such a cache alone. None given: a cache in q's "
                        "dtype")
    t.add_argument("--trials", type=int, default=64, help="trials (configurations measured), over all tile sizes")
    t.add_argument("--target", default=None, help="cpu, cuda, sm80, ...; none given: this machine's")
    t.add_argument("--seqlen", type=int, default=None,
                   help="the shape tuned on; none given: 4096 on a GPU, 512 on a CPU (decode: the KV length, "
                        "16384 on a GPU)")
    t.add_argument("--batch", type=int, default=None, help="none given: bench's tokens / --seqlen (decode: 32 on a GPU)")
    t.add_argument("--heads", type=int, default=None,
                   help="none given: bench's hidden / head_dim (decode: 32 query heads on a GPU, a quarter as many K/V heads)")
    t.add_argument("--work-dir", default=None, help="MetaSchedule's logs and database; none given: under the cache dir")
    t.add_argument("--cold", action="store_true",
                   help="start the search from nothing, as on a new GPU: no tuning records are read, and neither "
                        "they nor the defaults seed it (the defaults are still timed, for the speedup and as the "
                        "floor of what is stored). Without it the search starts from the defaults and the best "
                        "user and shipped records, and stores the fastest of them and its own where it beats the "
                        "knobs compile() takes now by more than the noise of repeated timings")

    k = command("cache", "list, show, clear or export the built modules and tuning records")
    k.add_argument("action", choices=["ls", "show", "clear", "export"])
    k.add_argument("key", nargs="?", default=None, help="show: a module key or tuning record id (a prefix will do)")
    k.add_argument("--out", default=None, help="export: the folder to write; none given: the shipped tuning_logs/")
    return p


def main(argv=None) -> int:
    p = parser()
    args = p.parse_args(argv)
    log = logging.getLogger("tvmflash")  # what is built or loaded, and how long it took (a GPU build on a CPU: 30 s)
    handler = None
    if not log.handlers:  # for this command only: a caller's stderr may be gone after it (a test's capture)
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("tvmflash: %(message)s"))
        log.addHandler(handler)
        log.setLevel(logging.INFO)
    try:
        code = {"info": _info, "compile": _compile, "bench": _bench, "tune": _tune, "cache": _cache}[args.command](args)
        sys.stdout.flush()  # here, where a closed pipe is caught, rather than at exit
        return code
    except (ValueError, TypeError) as err:  # bad input: say what, not where
        p.exit(2, f"tvmflash {args.command}: error: {err}\n")
    except BrokenPipeError:  # the reader went away (`tvmflash info | head -2`): stop quietly
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # what is left to flush goes nowhere
        return 1
    finally:
        if handler is not None:
            log.removeHandler(handler)


if __name__ == "__main__":
    sys.exit(main())
