"""The CPU tree-attention scratch layout per forward (`tree_attention.cpu_scratch`): before, a
loop over requests (~20 torch operations each, `_cpu_scratch_loop` below, the code it
replaced), after, every request at once (a constant number of operations); ms and torch
operators dispatched per call. And one attention layer over each layout (`_cpu_kernel_rows`,
checked bit-identical): after, every request's whole cache blocks are split into the scratch
512 KiB at a time (before, one copy per request), and the scratch's blocks are numbered
otherwise.

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


def _cpu_scratch_loop(layout, tables, requests, heads, dtype):
    """The layout before: `cpu_scratch` as a loop over requests (vllm_subspec d039025), kept
    verbatim but for its return (`whole`: a list of block-wise jobs)."""
    import torch
    from vllm import _custom_ops as ops

    from vllm_subspec.step.paged_kv import logical_to_slots
    from vllm_subspec.step.tree_attention import SCRATCH_BLOCK, CpuScratch

    bs, kv = SCRATCH_BLOCK, layout.kv_cache
    kv_heads, d = kv.shape[1], kv.shape[3] // 2
    masks = [r.tree_mask.to(device="cpu", dtype=torch.bool) for r in requests]
    seen = [m.sum(1) for m in masks]  # tree slots visible to each row
    cpu_tables = [t.to(device="cpu", dtype=torch.int64) for t in tables]
    split = [divmod(r.prefix_len, bs) for r in requests]  # whole scratch blocks; tokens after
    tails = [-(-(lead + int(s.max())) // bs) for (_, lead), s in zip(split, seen)]
    num_prefix = sum(full for full, _ in split)  # scratch: [shared prefix blocks][row tails]
    num_rows = sum(m.shape[0] for m in masks)
    num_tail = sum(m.shape[0] * t for m, t in zip(masks, tails))
    req_table = torch.zeros(num_rows, max(full + t for (full, _), t in zip(split, tails)),
                            dtype=torch.int32)
    whole_jobs, src, dst, query_rows = [], [], [], []
    prefix_at, tail_at, row = 0, num_prefix, 0
    for req, table, mask, s, (full, lead), tail in zip(requests, cpu_tables, masks, seen, split,
                                                       tails):
        q_len, L = mask.shape[0], req.prefix_len
        first = tail_at + torch.arange(q_len) * tail  # each row's first tail block
        req_table[row: row + q_len, :full] = prefix_at + torch.arange(full, dtype=torch.int32)
        req_table[row: row + q_len, full: full + tail] = (
            first[:, None] + torch.arange(tail)).to(torch.int32)
        # the prefix's whole scratch blocks, once: whole cache blocks as blocks, then tokens
        whole = full * bs // layout.block_size if layout.block_size % bs == 0 else 0
        if whole:
            whole_jobs.append((table[:whole], prefix_at))
        shared = torch.arange(whole * layout.block_size, full * bs)
        src.append(logical_to_slots(table, shared, layout.block_size))
        dst.append(prefix_at * bs + shared)
        # per row: the prefix's last `lead` tokens, then the tree slots it sees, in order
        r, j = mask.nonzero(as_tuple=True)  # row-major: each row's slots in ascending order
        rows = torch.cat([torch.arange(q_len).repeat_interleave(lead), r])
        logical = torch.cat([(full * bs + torch.arange(lead)).repeat(q_len), L + j])
        pos = torch.cat([torch.arange(lead).repeat(q_len),
                         lead + torch.arange(r.numel()) - (torch.cumsum(s, 0) - s)[r]])
        src.append(logical_to_slots(table, logical, layout.block_size))
        dst.append((first[rows] + pos // bs) * bs + pos % bs)
        query_rows.append(req.q_start + torch.arange(q_len))
        prefix_at, tail_at, row = prefix_at + full, tail_at + q_len * tail, row + q_len
    seq_lens = torch.cat([req.prefix_len + s for req, s in zip(requests, seen)]).to(torch.int32)
    starts = torch.arange(num_rows + 1, dtype=torch.int32)
    metadata = ops.cpu_attn_get_scheduler_metadata(
        num_reqs=num_rows, num_heads=heads, num_kv_heads=kv_heads, head_dim=d,
        seq_lens=seq_lens, dtype=dtype, query_start_loc=starts, causal=True,
        sliding_window_size=-1, isa=layout.isa, enable_kv_split=False)
    return CpuScratch(num_prefix + num_tail, num_prefix, whole_jobs, torch.cat(src),
                      torch.cat(dst), torch.cat(query_rows), req_table, seq_lens, starts,
                      metadata)


def _cpu_kernel_rows_loop(query, layout, plan, scale):
    """`_cpu_kernel_rows` before: one block-wise copy per job of `_cpu_scratch_loop`."""
    import torch
    from vllm import _custom_ops as ops

    from vllm_subspec.step.paged_kv import cpu_layout
    from vllm_subspec.step.tree_attention import SCRATCH_BLOCK

    kv = layout.kv_cache
    kv_heads, d, heads = kv.shape[1], kv.shape[3] // 2, query.shape[1]
    scratch = kv.new_empty(plan.num_blocks, kv_heads, SCRATCH_BLOCK, kv.shape[3])
    out_layout = cpu_layout(scratch, layout.isa)
    scratch[plan.num_prefix:].zero_()
    for blocks, first in plan.whole:
        layout.split_blocks(blocks, out_layout, first)
    out_layout.put(plan.dst, *layout.gather(plan.src))
    key_cache, value_cache = scratch.view(scratch.shape[0], kv_heads, 2 * SCRATCH_BLOCK,
                                          d).chunk(2, dim=2)
    out = torch.empty(plan.query_rows.numel(), heads, d, dtype=query.dtype)
    ops.cpu_attention_with_kv_cache(
        query=query[plan.query_rows], key_cache=key_cache, value_cache=value_cache, output=out,
        query_start_loc=plan.query_start_loc, seq_lens=plan.seq_lens, scale=scale, causal=True,
        alibi_slopes=None, sliding_window=-1, block_table=plan.block_table, softcap=0.0,
        scheduler_metadata=plan.metadata, s_aux=None)
    return out


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
    """Both layouts of one forward's requests (ms, operators) and one layer over each (ms)."""
    import torch

    from vllm_subspec.step.tree_attention import _cpu_kernel_rows, cpu_scratch

    heads, d = query.shape[1], query.shape[2]
    scale = d ** -0.5

    def before():
        return _cpu_scratch_loop(layout, list(tables), requests, heads, query.dtype)

    def after():
        return cpu_scratch(layout, tables, requests, heads, query.dtype)

    plan_before, plan_after = before(), after()

    def layer_before():
        return _cpu_kernel_rows_loop(query, layout, plan_before, scale)

    def layer_after():
        return _cpu_kernel_rows(query, layout, plan_after, scale)

    inner = max(1, 64 // len(requests))
    return {"layout_ms_before": 1e3 * best_of(before, repeats, inner),
            "layout_ms_after": 1e3 * best_of(after, repeats, inner),
            "operators_before": operators(before), "operators_after": operators(after),
            "layer_ms_before": 1e3 * best_of(layer_before, repeats, 1),
            "layer_ms_after": 1e3 * best_of(layer_after, repeats, 1),
            "bit_identical": torch.equal(layer_before(), layer_after())}


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
    lines = ["# CPU tree-attention scratch layout: a loop over requests vs all at once", "",
             f"Command: `{report['command']}`", "",
             ("Per forward, `cpu_scratch` (layout, ms: the best of "
              f"{args.repeats} means; torch operators dispatched per call); per attention layer, "
              "`_cpu_kernel_rows` over that layout (scratch fill and the kernel, ms), its rows "
              "bit-identical either way. Before: a loop over requests (vllm_subspec d039025); "
              f"after: every request at once. k = {args.width} rows per request at depth "
              f"{args.depth} (draft level: over m = {1 + args.depth * args.width} slots; verify: "
              "each request its whole tree of depth 1 + i % depth), prefixes of about the "
              f"context; 12 heads, 2 KV heads, head dim 128, bf16, 128-token cache blocks, "
              f"ISA {args.isa}, one thread."), "",
             ("| context | kind | requests | rows | layout ms before | after | operators before "
              "| after | layer ms before | after | identical |"),
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        lines.append(f"| {r['context']} | {r['kind']} | {r['batch']} | {r['rows']} | "
                     f"{r['layout_ms_before']:.3f} | {r['layout_ms_after']:.3f} | "
                     f"{r['operators_before']} | {r['operators_after']} | "
                     f"{r['layer_ms_before']:.3f} | {r['layer_ms_after']:.3f} | "
                     f"{'yes' if r['bit_identical'] else 'NO'} |")
    env = report["environment"]
    lines += ["", (f"Machine: {env['cpu']} ({env['cores']} cores); "
                   f"torch {env['torch']}; vLLM {env['vllm']}; {env['date']}.")]
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
