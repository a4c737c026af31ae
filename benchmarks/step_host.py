"""What a SubSpec step costs the host, beyond its forwards: the verify's (positions, vLLM's rules
at every node, the draws, the walk, the KV moves) and the draft loop's per pass.

No engine: the real `StepSession` and `SampleMatchVerifier` over stand-ins for vLLM's runner
(`subspec_testing.stub_verify`), a 64-token vocabulary so the tensor work is negligible and the
time is Python and operator dispatch, which on a GPU the host pays while the device waits at the
verify's one read of the draws. Per (requests, output tokens so far, penalties): ms per verify
step, and the draft loop's ms per pass (`draft_tree` over passes that cost nothing). Writes
benchmarks/results/<name>.{json,md}; `benchmarks/projection.py` adds these to a GPU step.

    python -m benchmarks.step_host --name step_host
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from benchmarks.depth_sweep import RESULTS, environment
from vllm_subspec.step.tree_attention import TreeRows


def verify_ms(batch: int, output_len: int, penalties: bool, repeats: int) -> float:
    from subspec_testing.stub_verify import run_verify, sampling, verify_step

    best = float("inf")
    for _ in range(repeats):
        verifier, scheduled, logits = verify_step(batch)
        meta = sampling(batch, output_len, logits.shape[-1], penalties)
        t = time.perf_counter()
        run_verify(verifier, scheduled, logits, meta)
        best = min(best, time.perf_counter() - t)
    return 1e3 * best


class FreePasses:
    """`DraftPasses` whose forwards cost nothing: hidden states are the tokens."""

    on_device, max_model_len, max_rows = False, 1 << 20, 1 << 20

    def __init__(self, batch: int, vocab: int = 64):
        import torch

        self.batch_size = batch
        self.table = torch.randn(vocab, vocab)
        self.roots = torch.arange(batch) * 100 + 50

    def bonus_pass(self, tokens):
        return tokens[:, None].float(), self.roots

    def tree_rows(self, row, q_start, request, root, mask):
        return TreeRows(row, q_start, root, mask)

    def level_pass(self, depth, width, tokens, active):
        return tokens[:, None].float()

    def logits(self, hidden, lm_head):
        return self.table[hidden[:, 0].long()]

    def root_bounds(self, roots):
        return roots.tolist()


def draft_ms_per_pass(batch: int, width: int, depth: int, repeats: int) -> float:
    import torch

    from vllm_subspec.step.draft import draft_tree
    from vllm_subspec.step.tree import TreeShape

    best = float("inf")
    for _ in range(repeats):
        passes = FreePasses(batch)
        t = time.perf_counter()
        draft = draft_tree(passes, torch.zeros(batch, dtype=torch.int64),
                           TreeShape(width, depth), 0.2)
        best = min(best, (time.perf_counter() - t) / draft.passes)
    return 1e3 * best


def main() -> None:
    import torch

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--outputs", type=int, nargs="+", default=[10, 1000])
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--name", default="step_host")
    args = ap.parse_args()
    torch.set_num_threads(1)
    rows = []
    for batch in args.batches:
        for output_len in args.outputs:
            for penalties in (False, True):
                rows.append({"batch": batch, "output_len": output_len, "penalties": penalties,
                             "verify_ms": verify_ms(batch, output_len, penalties,
                                                    args.repeats)})
                print(rows[-1], flush=True)
    draft = [{"batch": b, "ms_per_pass": draft_ms_per_pass(b, 6, 16, args.repeats)}
             for b in args.batches]
    print(draft, flush=True)
    report = {"command": " ".join(["python -m benchmarks.step_host", *sys.argv[1:]]),
              "environment": environment(), "verify": rows, "draft": draft}
    out = RESULTS / args.name
    out.with_suffix(".json").write_text(json.dumps(report, indent=1) + "\n")
    lines = ["# A step's host work beyond its forwards", "", f"Command: `{report['command']}`",
             "", "Verify (7-node trees, every request's path moved, sampled at T 0.8, top-p "
             "0.9; penalties: repetition 1.05, frequency 0.2, presence 0.1), best of "
             f"{args.repeats}, one thread:", "",
             "| requests | output tokens so far | penalties | ms per verify step |",
             "|---|---|---|---|"]
    lines += [f"| {r['batch']} | {r['output_len']} | {'yes' if r['penalties'] else 'no'} | "
              f"{r['verify_ms']:.2f} |" for r in rows]
    lines += ["", "Draft loop (a 6 x 16 tree, passes that cost nothing): ms per pass", "",
              "| requests | ms per pass |", "|---|---|"]
    lines += [f"| {d['batch']} | {d['ms_per_pass']:.3f} |" for d in draft]
    env = report["environment"]
    lines += ["", f"Machine: {env['cpu']} ({env['cores']} cores); torch {env['torch']}; "
                  f"vLLM {env['vllm']}; {env['date']}."]
    lines += ["", f"![step host]({out.name}.png)"]
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    from benchmarks.plots import plot_step_host

    plot_step_host(report, out.with_suffix(".png"))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
