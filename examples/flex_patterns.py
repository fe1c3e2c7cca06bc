"""FlexAttention's common patterns on tvmflash.flex_attention, beside torch.compile'd FlexAttention and tvmflash's
built-in variants (issue 45's goal grid).

    python examples/flex_patterns.py                                   # GPU: bf16 d128, 16 heads, 2k..16k tokens
    python examples/flex_patterns.py --patterns causal document --seqlens 4096 8192 --json flex.json
    python examples/flex_patterns.py --no-backward                     # forward only

The patterns (``tvmflash.flex_patterns``): causal and a sliding window as mask_mods, a document mask over
packed sequences, prefix-LM, ALiBi and a tanh softcap as score_mods, and a learnable relative-position bias
(a captured table that requires grad). A pattern with a mask runs twice: with the mask_mod alone (every
K/V tile visited and masked) and with torch's BlockMask of it (``create_block_mask``: the empty tiles never
loaded); torch's FlexAttention always gets the BlockMask, the only way it takes a mask.

Each pattern is first checked against float64 (the mods applied to the whole score matrix in torch), forward
and gradients (q, k, v and a learnable table's), with flash-attn's rule: our error at most 2x the error of
the same attention in the inputs' dtype, plus 1e-5 (times 1 + the largest element, for gradients), on
batch 2 at the shortest sequence length (at most 1024). Then each sequence length is timed with
``tvmflash.bench.time_backends`` (clock-fair rounds): the forward under no_grad, and forward + backward
through autograd. TFLOP/s counts the pairs the mask keeps (causal: about half), the backward 2.5x the
forward (flash-attn's convention). Ratios are the other's time over tvmflash's: above 1.00x, tvmflash is
faster; "vs built-in" compares the flex pattern with tvmflash's own causal, window, softcap or ALiBi kernel
(the issue's goal: a mask_mod causal within 3% of the built-in causal, i.e. at 0.97x or more).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import sys
import time
import warnings

import torch
from torch.nn.attention.flex_attention import create_block_mask, flex_attention

import tvmflash
from tvmflash import bench, choice, flex_patterns, program_flex_gradient
from tvmflash.flex_trace import trace_mods

GPU_DEFAULTS = {"dtype": "bfloat16", "head_dim": 128, "heads": 16, "tokens": 16384,
                "seqlens": [2048, 4096, 8192, 16384], "torch": "compile", "window": flex_patterns.WINDOW}
# small enough for two CPU cores in about a minute (the kernels' builds included)
CPU_DEFAULTS = {"dtype": "float32", "head_dim": 32, "heads": 2, "tokens": 256, "seqlens": [128, 256], "torch": "eager",
                "window": 48}
CHECK_SEQLEN, CHECK_BATCH = 1024, 2


# ----------------------------------------------------------------------------- the float64 check
def _error(ours, ref, same, gradient: bool) -> tuple[float, float]:
    """(our max error against ``ref``, flash-attn's bound: 2x torch's same-dtype error + 1e-5, for a
    gradient times 1 + its largest element)."""
    err = (ours.double() - ref.double()).abs().max().item()
    theirs = (same.double() - ref.double()).abs().max().item()
    floor = 1e-5 * (1 + ref.abs().max().item()) if gradient else 1e-5
    return err, 2 * theirs + floor


def check(pattern, dtype, heads: int, head_dim: int, seqlen: int, device, block_mask: bool, backward: bool) -> dict:
    """Forward and (``backward``) gradients of tvmflash.flex_attention against float64: name -> (error,
    bound), for out, dq, dk, dv and each learnable captured tensor (``dcaptured0``, ...)."""
    gen = torch.Generator().manual_seed(seqlen)
    q, k, v, dout = (torch.randn(CHECK_BATCH, heads, seqlen, head_dim, generator=gen).to(device=device, dtype=dtype)
                     for _ in range(4))
    mask = pattern.mask_mod
    if mask is not None and block_mask:
        mask = create_block_mask(pattern.mask_mod, CHECK_BATCH, None, seqlen, seqlen, device=device)
    leaves = [t.clone().requires_grad_(backward) for t in (q, k, v)]
    learned = pattern.learned if backward else []
    out = tvmflash.flex_attention(*leaves, score_mod=pattern.score_mod, block_mask=mask)
    ours = torch.autograd.grad(out, leaves + learned, dout) if backward else ()
    results = []
    for ref_dtype in (torch.float64, dtype):
        ref_leaves = [t.to(ref_dtype).requires_grad_(backward) for t in (q, k, v)]
        ref_out = flex_patterns.reference(*ref_leaves, pattern, ref_dtype)
        grads = torch.autograd.grad(ref_out, ref_leaves + learned, dout.to(ref_dtype)) if backward else ()
        results.append((ref_out.detach(), grads))
    (ref, ref_grads), (same, same_grads) = results
    errors = {"out": _error(out.detach(), ref, same, False)}
    names = ["dq", "dk", "dv"] + [f"dcaptured{n}" for n in range(len(learned))]
    for name, g, r, s in zip(names, ours, ref_grads, same_grads):
        errors[name] = _error(g, r, s, True)
    return errors


# ----------------------------------------------------------------------------- timing
def calls(pattern, q, k, v, dout, mask, torch_mask, compiled, backward: bool) -> dict:
    """backend -> a call of one forward (on detached inputs, under no_grad) or with ``backward`` forward and
    backward: tvmflash, torch's FlexAttention (``compiled``, or None) and tvmflash's built-in kernel of the
    pattern where it has one. A backend that refuses the call (torch's FlexAttention has no backward on the
    CPU) is left out."""
    learned = pattern.learned
    if not backward:
        q, k, v = (t.detach() for t in (q, k, v))

    def timed(attend):
        def call():
            if not backward:
                with torch.no_grad():
                    return attend()
            for t in (q, k, v, *learned):
                t.grad = None
            attend().backward(dout)
        return call

    found = {"tvmflash": timed(lambda: tvmflash.flex_attention(q, k, v, score_mod=pattern.score_mod, block_mask=mask))}
    if compiled is not None:
        found["torch"] = timed(lambda: compiled(q, k, v, score_mod=pattern.score_mod, block_mask=torch_mask))
    if pattern.builtin is not None:
        found["built-in"] = timed(lambda: tvmflash.attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                                             **pattern.builtin).transpose(1, 2))
    for name in ("torch", "built-in"):
        try:
            if name in found:
                found[name]()
        except (NotImplementedError, RuntimeError):  # this backend does not take this call
            del found[name]
    return found


def builds(args) -> list[tuple[str, dict]]:
    """The modules the run needs (``bench.build_in_parallel``'s builds): each pattern's forward and backward,
    with and without its BlockMask, and the built-in kernels beside them."""
    found = []
    heads = {"heads_q": args.heads, "heads_kv": args.heads}
    for name in args.patterns:
        pattern = flex_patterns.make(name, 1, args.heads, 256, "cpu", window=args.window)
        variants = (False, True) if pattern.mask_mod is not None else (False,)
        variants_of = [{"flex": flex_patterns.TuningCase(name, block_mask, args.window)(1, args.heads, 256, "cpu")[0]}
                       for block_mask in variants]
        if pattern.builtin is not None:
            variants_of.append({"alibi": True} if "alibi_slopes" in pattern.builtin else pattern.builtin)
        # a learned table's gradient: made by the backward's dkdv where flex_attention has it made there
        traced, captured = trace_mods(pattern.score_mod, pattern.mask_mod)
        learned = program_flex_gradient.learnable(traced.score, captured) if choice.capture_gradients_in_kernel(
            torch.device(args.device).type, torch.are_deterministic_algorithms_enabled()) else ()
        for variant in variants_of:
            for program in ("compile",) + (() if args.no_backward else ("compile_backward",)):
                if program == "compile_backward" and learned and "flex" in variant:
                    variant = {"flex": dataclasses.replace(variant["flex"], learned=learned)}
                found.append((program, {"head_dim": args.head_dim, "dtype": args.dtype, **variant, **heads}))
    return found


def run(args, echo=functools.partial(print, flush=True)) -> list[dict]:
    """Check and time every pattern at every sequence length; a row (a dict) each pattern, variant and
    length, echoed as a table."""
    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype)
    compiled = {"compile": torch.compile(flex_attention, dynamic=False), "eager": flex_attention,
                "none": None}[args.torch]
    if args.torch == "compile":
        # one compile a pattern, length and pass (dynamic=False: FlexAttention's fastest kernels); past Dynamo's
        # recompile limit (8) it would run the rest eagerly, its slow reference math, and say nothing
        torch._dynamo.config.recompile_limit = torch._dynamo.config.accumulated_recompile_limit = 4096
        torch._dynamo.config.fail_on_recompile_limit_hit = True
    if args.torch == "eager":  # its warning that eager is the slow reference: said in the header
        warnings.filterwarnings("ignore", message="flex_attention called without torch.compile")
    passes = ("forward",) if args.no_backward else ("forward", "forward+backward")
    echo(f"tvmflash.flex_attention patterns on {bench.device_name(device)}, {time.strftime('%Y-%m-%d')}, tvmflash "
         f"{bench.version()}: {args.dtype} d{args.head_dim}, {args.heads} heads, batch*seqlen = {args.tokens}; torch's "
         f"FlexAttention {args.torch}"
         + (" (its unfused reference math, not its kernel)" if args.torch == "eager" else ""))
    if device.type == "cuda":  # every module first, on every core (a GPU module builds in tens of seconds)
        start, needed = time.perf_counter(), builds(args)
        bench.build_in_parallel(needed, args.jobs, echo=lambda line: None)  # (a line each names the whole trace)
        echo(f"built or loaded {len(needed)} modules in {time.perf_counter() - start:.0f} s, {args.jobs} at a time")
    header = (f"{'pattern':<15} {'variant':<10} {'seqlen':>6} {'batch':>5} {'pass':<16} {'tvmflash ms':>11} "
              f"{'TFLOP/s':>7} {'torch ms':>9} {'TFLOP/s':>7} {'vs torch':>8} {'built-in':>9} {'vs built-in':>11}")
    rows = []
    for name in args.patterns:
        check_seqlen = min(min(args.seqlens), CHECK_SEQLEN)
        pattern = flex_patterns.make(name, CHECK_BATCH, args.heads, check_seqlen, device, window=args.window)
        variants = ["mask_mod", "BlockMask"] if pattern.mask_mod is not None else ["score_mod"]
        verdicts = {}
        for variant in variants:
            errors = check(pattern, dtype, args.heads, args.head_dim, check_seqlen, device, variant == "BlockMask",
                           not args.no_backward)
            failed = [what for what, (err, bound) in errors.items() if not err <= bound]
            verdicts[variant] = {"passed": not failed, "errors": errors}
            echo(f"{name} ({flex_patterns.PATTERNS[name]}), {variant}: check against float64 at b{CHECK_BATCH} "
                 f"s{check_seqlen} {'PASSED' if not failed else 'FAILED (' + ', '.join(failed) + ')'}: "
                 + ", ".join(f"{what} {err:.2e} <= {bound:.2e}" if err <= bound else f"{what} {err:.2e} > {bound:.2e}"
                             for what, (err, bound) in errors.items()))
        echo(header)
        for seqlen in args.seqlens:
            batch = max(1, args.tokens // seqlen)
            pattern = flex_patterns.make(name, batch, args.heads, seqlen, device, window=args.window)
            gen = torch.Generator().manual_seed(seqlen + 1)
            q, k, v, dout = (torch.randn(batch, args.heads, seqlen, args.head_dim, generator=gen).to(
                device=device, dtype=dtype) for _ in range(4))
            q, k, v = (t.requires_grad_(not args.no_backward) for t in (q, k, v))
            flops = 4 * batch * args.heads * seqlen * seqlen * args.head_dim * pattern.visible(batch, seqlen, seqlen,
                                                                                                 device)
            torch_mask = None if pattern.mask_mod is None else create_block_mask(pattern.mask_mod, batch, None, seqlen,
                                                                                  seqlen, device=device)
            for variant in variants:
                mask = torch_mask if variant == "BlockMask" else pattern.mask_mod
                for pass_ in passes:
                    backward = pass_ != "forward"
                    times = bench.time_backends(calls(pattern, q, k, v, dout, mask, torch_mask, compiled, backward),
                                                device, args.repeat)
                    work = flops * (3.5 if backward else 1.0)
                    row = {"pattern": name, "variant": variant, "seqlen": seqlen, "batch": batch, "heads": args.heads,
                           "head_dim": args.head_dim, "dtype": args.dtype, "pass": pass_, "flops": work,
                           "times_ms": times, "check": verdicts[variant]}
                    rows.append(row)
                    echo(_line(row))
    return rows


def _line(row: dict) -> str:
    times, work = row["times_ms"], row["flops"]
    ours = times["tvmflash"]

    def cell(backend, width):
        ms = times.get(backend)
        return (f"{ms:>{width}.3f} {work / ms / 1e9:>7.3g}" if ms else f"{'-':>{width}} {'-':>7}")
    theirs, builtin = times.get("torch"), times.get("built-in")
    return (f"{row['pattern']:<15} {row['variant']:<10} {row['seqlen']:>6} {row['batch']:>5} {row['pass']:<16} "
            f"{cell('tvmflash', 11)} {cell('torch', 9)} "
            f"{(f'{theirs / ours:.2f}x' if theirs else '-'):>8} {(f'{builtin:.3f}' if builtin else '-'):>9} "
            f"{(f'{builtin / ours:.3f}x' if builtin else '-'):>11}")


def parse_args(argv=None):
    cuda = torch.cuda.is_available()
    defaults = GPU_DEFAULTS if cuda else CPU_DEFAULTS
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda" if cuda else "cpu")
    parser.add_argument("--dtype", default=defaults["dtype"], choices=["float16", "bfloat16", "float32"])
    parser.add_argument("--head-dim", type=int, default=defaults["head_dim"])
    parser.add_argument("--heads", type=int, default=defaults["heads"])
    parser.add_argument("--tokens", type=int, default=defaults["tokens"], help="batch * seqlen")
    parser.add_argument("--seqlens", type=int, nargs="+", default=defaults["seqlens"])
    names = list(flex_patterns.PATTERNS)
    parser.add_argument("--patterns", nargs="+", default=names, choices=names)
    parser.add_argument("--window", type=int, default=defaults["window"], help="sliding-window: the keys a query sees "
                        "behind it")
    parser.add_argument("--no-backward", action="store_true", help="the forward alone (checked and timed)")
    parser.add_argument("--torch", default=defaults["torch"], choices=["compile", "eager", "none"],
                        help="torch's FlexAttention beside: torch.compile'd (its fast kernel), eager (its reference "
                             "math: slow) or not at all")
    parser.add_argument("--repeat", type=int, default=10, help="timed calls a backend and round")
    parser.add_argument("--jobs", type=int, default=os.cpu_count(), help="processes that build the GPU's kernels first")
    parser.add_argument("--json", default=None, metavar="FILE", help="also write the rows, with the device and "
                                                                    "commit, to FILE as JSON")
    return parser.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    rows = run(args)
    failed = sorted({f"{r['pattern']} {r['variant']}" for r in rows if not r["check"]["passed"]})
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": bench.device_name(torch.device(args.device)), "date": time.strftime("%Y-%m-%d"),
                       "version": bench.version(), "args": vars(args), "rows": rows}, f, indent=1)
        print(f"wrote {args.json}")
    if failed:
        print(f"ERROR: the float64 check failed for {', '.join(failed)}", file=sys.stderr)
        return 1
    print("every pattern passed the float64 check (flash-attn's rule)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
