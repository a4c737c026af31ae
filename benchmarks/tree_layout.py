"""The CPU tree-attention scratch layout per forward (`tree_attention.cpu_scratch`: every
request at once, in a number of torch operations that does not grow with the requests): ms and
torch operators dispatched per call, and one attention layer over it (`_cpu_kernel_rows`), its
rows checked bit-identical to each request's rows computed alone
(`subspec_testing.reference.tree_attention_rows`).
(The loop over requests it replaced, ~20 operations a request, was measured against it at
d039025: benchmarks/results/tree_layout.md of that commit, docs/results.md.)

Requests as a draft level sends them (k rows, the k nodes of depth `depth`, over every slot up
to them: m = 1 + depth * k) and as a verify does (each its whole tree, its own size), each with
a prefix of about `context` tokens (spread by a few tokens, so requests differ); Qwen2.5-Coder-
1.5B's attention shape (12 heads, 2 KV heads, head dim 128, bf16, 128-token cache blocks); torch
on one thread, as vLLM's CPU worker runs. Writes benchmarks/results/<name>.{json,md}.

    python -m benchmarks.tree_layout --name tree_layout
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from benchmarks.depth_sweep import RESULTS, environment


def best_of(fn, repeats: int, inner: int) -> float:
    """Seconds per call: the best of `repeats` means over `inner` calls."""
    fn()
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        for _ in range(inner):
            fn()
        times.append((time.perf_counter() - t) / inner)
    return min(times)


def operators(fn) -> int:
    """Torch operators `fn` dispatches."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.n += 1
            return func(*args, **(kwargs or {}))

    with Count() as count:
        fn()
    return count.n


def requests_of(kind: str, batch: int, context: int, width: int, depth: int, gen):
    """`batch` requests' tree rows: a draft level's (k rows over 1 + depth * k slots, every
    request alike) or a verify's (each its whole tree, depth 1 + i % depth)."""
    import torch

    from vllm_subspec.step.tree import TreeBatch, TreeShape
    from vllm_subspec.step.tree_attention import TreeRows

    rows, at = [], 0
    for i in range(batch):
        d = depth if kind == "draft level" else 1 + i % depth
        shape = TreeShape(width, d)
        tree = TreeBatch(shape, torch.tensor([0]))
        tree.grow(torch.randn(1, 11, generator=gen).log_softmax(-1))
        for _ in range(d - 1):
            tree.grow(torch.randn(1, width, 11, generator=gen).log_softmax(-1))
        level = shape.level(d)
        mask = tree.mask[0, level, : level.stop] if kind == "draft level" else tree.mask[0]
        rows.append(TreeRows(i, at, context + 7 * i % 61, mask))
        at += mask.shape[0]
    return rows, at


def measure(layout, tables, requests, query, repeats: int) -> dict:
    """One forward's layout (ms, operators) and one layer over it (ms, bit-identical to each
    request alone)."""
    import torch

    from subspec_testing.reference import tree_attention_rows
    from vllm_subspec.step.tree_attention import _cpu_kernel_rows, cpu_scratch

    heads, d = query.shape[1], query.shape[2]
    scale = d ** -0.5

    def layout_all():
        return cpu_scratch(layout, tables, requests, heads, query.dtype)

    plan = layout_all()

    def layer():
        return _cpu_kernel_rows(query, layout, plan, scale)

    out = torch.empty_like(query)
    out[plan.query_rows] = layer()
    alone = all(torch.equal(out[r.q_start: r.q_start + r.tree_mask.shape[0]],
                            tree_attention_rows(query, layout, tables[i], r, scale))
                for i, r in enumerate(requests))
    inner = max(1, 64 // len(requests))
    return {"layout_ms": 1e3 * best_of(layout_all, repeats, inner),
            "operators": operators(layout_all),
            "layer_ms": 1e3 * best_of(layer, repeats, 1), "bit_identical": alone}


def main():
    import torch

    from vllm_subspec.step.paged_kv import cpu_layout

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 4, 8, 32])
    ap.add_argument("--contexts", type=int, nargs="+", default=[512, 4096])
    ap.add_argument("--width", type=int, default=6, help="k: nodes per depth")
    ap.add_argument("--depth", type=int, default=4)
    ap.add_argument("--isa", default="vec", choices=["vec", "amx"],
                    help="the CPU attention ISA (vLLM picks amx for bf16 on CPUs with AMX)")
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--name", default="tree_layout")
    args = ap.parse_args()
    torch.set_num_threads(1)
    if args.isa == "amx":
        torch.cpu._init_amx()  # the tile permission vLLM's CPU worker has
    heads, kv_heads, d, block, dtype = 12, 2, 128, 128, torch.bfloat16
    gen = torch.Generator().manual_seed(0)
    results = []
    for context in args.contexts:
        per = -(-(context + 61 + 1 + args.depth * args.width) // block)  # cache blocks each
        kv = torch.randn(max(args.batches) * per, kv_heads, block, 2 * d, generator=gen) \
            .to(dtype)
        layout = cpu_layout(kv, args.isa)
        for kind in ("draft level", "verify"):
            for batch in args.batches:
                requests, num_rows = requests_of(kind, batch, context, args.width, args.depth,
                                                 gen)
                tables = torch.randperm(kv.shape[0], generator=gen)[: batch * per] \
                    .view(batch, per).to(torch.int32)
                query = torch.randn(num_rows, heads, d, generator=gen).to(dtype)
                row = {"context": context, "kind": kind, "batch": batch, "rows": num_rows,
                       **measure(layout, tables, requests, query, args.repeats)}
                results.append(row)
                print(row, flush=True)
    report = {"command": " ".join(["python -m benchmarks.tree_layout", *sys.argv[1:]]),
              "isa": args.isa, "environment": environment(), "results": results}
    out = RESULTS / args.name
    out.with_suffix(".json").write_text(json.dumps(report, indent=1) + "\n")
    lines = ["# CPU tree-attention scratch layout, every request at once", "",
             f"Command: `{report['command']}`", "",
             ("Per forward, `cpu_scratch` (layout, ms: the best of "
              f"{args.repeats} means; torch operators dispatched per call); per attention layer, "
              "`_cpu_kernel_rows` over that layout (scratch fill and the kernel, ms), its rows "
              "bit-identical to each request's computed alone. "
              f"k = {args.width} rows per request at depth "
              f"{args.depth} (draft level: over m = {1 + args.depth * args.width} slots; verify: "
              "each request its whole tree of depth 1 + i % depth), prefixes of about the "
              f"context; 12 heads, 2 KV heads, head dim 128, bf16, 128-token cache blocks, "
              f"ISA {args.isa}, one thread."), "",
             "| context | kind | requests | rows | layout ms | operators | layer ms | identical |",
             "|---|---|---|---|---|---|---|---|"]
    for r in results:
        lines.append(f"| {r['context']} | {r['kind']} | {r['batch']} | {r['rows']} | "
                     f"{r['layout_ms']:.3f} | {r['operators']} | {r['layer_ms']:.3f} | "
                     f"{'yes' if r['bit_identical'] else 'NO'} |")
    env = report["environment"]
    lines += ["", (f"Machine: {env['cpu']} ({env['cores']} cores); "
                   f"torch {env['torch']}; vLLM {env['vllm']}; {env['date']}.")]
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
