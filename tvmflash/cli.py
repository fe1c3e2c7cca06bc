"""The ``tvmflash`` command: info, compile, bench."""

from __future__ import annotations

import argparse
import json
import sys


def _info(args) -> int:
    import torch
    import tvm

    import tvmflash
    from tvmflash import cache, schedules, target

    resolved = target.resolve(None)
    print(f"tvmflash {tvmflash.__version__}, TVM {tvm.__version__}, torch {torch.__version__}")
    if torch.cuda.is_available():
        major, minor = torch.cuda.get_device_capability()
        print(f"GPU: {torch.cuda.get_device_name()} (compute capability {major}.{minor})")
    else:
        print("GPU: none visible to torch")
    names = {schedules.name_of(schedules.for_target(resolved, dtype)) for dtype in ("bfloat16", "float32")}
    print(f"default target: {target.describe(resolved)} -> schedules {', '.join(sorted(names))}")
    print(f"cache dir: {cache.cache_dir()}")
    entries = cache.list_modules()
    print(f"cached modules: {len(entries)}")
    for e in entries:
        spec = e.get("spec", {})
        print(f"  {e.get('key')}  {e.get('schedule')}  d{spec.get('head_dim')} {spec.get('dtype')} "
              f"{'causal' if spec.get('causal') else 'full'} hq{spec.get('heads_q')}/hkv{spec.get('heads_kv')}  "
              f"{e['bytes'] // 1024} KiB  {e.get('created', '')}")
    return 0


def _compile(args) -> int:
    import tvmflash

    kernel = tvmflash.compile(head_dim=args.head_dim, dtype=args.dtype, causal=args.causal, target=args.target,
                              knobs=json.loads(args.knobs) if args.knobs else None)
    heads_kv = args.heads_kv or args.heads_q
    if args.emit == "cuda":
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
    from tvmflash import bench

    results = bench.run(device=args.device, dtype=args.dtype, head_dims=args.head_dim,
                        causal={"no": (False,), "yes": (True,), "both": (False, True)}[args.causal],
                        seqlens=args.seqlens, tokens=args.tokens, hidden=args.hidden, repeat=args.repeat,
                        target=args.target, knobs=json.loads(args.knobs) if args.knobs else None)
    print("ratios are the backend's time over tvmflash's: above 1.00x, tvmflash is faster")
    failed = [r.config for r in results if r.error > r.tolerance]
    if failed:
        print(f"ERROR: {len(failed)} configurations exceeded the error tolerance: {failed}", file=sys.stderr)
        return 1
    return 0


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="tvmflash", description="FlashAttention from one TVM TensorIR program")
    sub = p.add_subparsers(dest="command", required=True)

    sub.add_parser("info", help="TVM version, detected GPU and target, cache dir and contents")

    c = sub.add_parser("compile", help="build a kernel and write its CUDA source (or scheduled TensorIR)")
    c.add_argument("--target", default=None, help="cpu, cuda, sm80, sm86, sm89, sm90 (default: this machine)")
    c.add_argument("--head-dim", type=int, required=True)
    c.add_argument("--dtype", default="bfloat16", choices=["float16", "bfloat16", "float32"])
    c.add_argument("--causal", action="store_true")
    c.add_argument("--heads-q", type=int, default=16)
    c.add_argument("--heads-kv", type=int, default=None, help="default: --heads-q")
    c.add_argument("--knobs", default=None, help='schedule knobs as JSON, e.g. \'{"block_m": 64}\'')
    c.add_argument("--emit", default="cuda", choices=["cuda", "tir"])
    c.add_argument("-o", "--output", default=None)

    b = sub.add_parser("bench", help="time tvmflash against torch SDPA on the same inputs")
    b.add_argument("--device", default=None, help="cpu or cuda (default: cuda if present)")
    b.add_argument("--dtype", default="bfloat16", choices=["float16", "bfloat16", "float32"])
    b.add_argument("--head-dim", type=int, nargs="+", default=[64, 128])
    b.add_argument("--causal", default="both", choices=["no", "yes", "both"])
    b.add_argument("--seqlens", type=int, nargs="+", default=None)
    b.add_argument("--tokens", type=int, default=None, help="batch * seqlen (default: 16384 on a GPU)")
    b.add_argument("--hidden", type=int, default=None, help="heads * head_dim (default: 2048 on a GPU)")
    b.add_argument("--repeat", type=int, default=20)
    b.add_argument("--target", default=None)
    b.add_argument("--knobs", default=None)
    return p


def main(argv=None) -> int:
    p = parser()
    args = p.parse_args(argv)
    try:
        return {"info": _info, "compile": _compile, "bench": _bench}[args.command](args)
    except (ValueError, TypeError) as err:  # bad input: say what, not where
        p.exit(2, f"tvmflash {args.command}: error: {err}\n")


if __name__ == "__main__":
    sys.exit(main())
