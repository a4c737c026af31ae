"""Routed experts' Triton kernels (draft_model/experts_triton.py) run under the Triton
interpreter on CPU tensors, through `experts.routed_experts` as the draft's operator calls them,
against the same 4-bit experts computed densely in fp32. Writes {case: result} as JSON.

Usage: TRITON_INTERPRET=1 python experts_triton_probe.py OUT_JSON
"""

import json
import os
import sys

assert os.environ.get("TRITON_INTERPRET") == "1", "run with TRITON_INTERPRET=1"

from gemlite_shim import patch_interpreter_bf16  # noqa: E402 (this folder)

patch_interpreter_bf16()  # the interpreter's bf16 computed as a GPU computes it

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from vllm_subspec.draft_model.experts import (  # noqa: E402
    TritonExpertKernel,
    expert_tensors,
    routed_experts,
)
from vllm_subspec.draft_model.quantize import quantize  # noqa: E402

# (rows, experts, top_k, hidden, intermediate, group size, routing): "skewed" routes every
# row's first slot to expert 0 (one expert holds several blocks of pairs) and leaves the last
# expert without rows
CASES = {
    "one_row": (1, 4, 2, 128, 64, 64, "random"),
    "tree_level": (6, 8, 2, 128, 192, 64, "random"),
    "skewed_top3_g32": (37, 8, 3, 64, 128, 32, "skewed"),
    "top4_g128": (16, 4, 4, 256, 128, 128, "random"),
}


def routing(m, e, k, kind, gen):
    ids = torch.stack([torch.randperm(e, generator=gen)[:k] for _ in range(m)])
    if kind == "skewed":
        ids = torch.stack([torch.cat([torch.tensor([0]),
                                      1 + torch.randperm(e - 2, generator=gen)[:k - 1]])
                           for _ in range(m)])
    weights = torch.softmax(torch.randn(m, k, generator=gen), -1)
    return weights, ids.to(torch.int32)


def dense_fp32(x, weights, ids, q13, q2):
    out = torch.zeros(x.shape[0], q2[0].shape[0])
    for r in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[r, j])
            h = q13[e].dequantize(torch.float32) @ x[r].float()
            d = h.shape[0] // 2
            out[r] += weights[r, j] * (q2[e].dequantize(torch.float32)
                                       @ (F.silu(h[:d]) * h[d:]))
    return out


def run_case(m, e, k, hidden, inter, group, kind, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q13 = [quantize(torch.randn(2 * inter, hidden, generator=gen) * 0.05, 4, group)
           for _ in range(e)]
    q2 = [quantize(torch.randn(hidden, inter, generator=gen) * 0.05, 4, group)
          for _ in range(e)]
    x = torch.randn(m, hidden, generator=gen).to(dtype)
    weights, ids = routing(m, e, k, kind, gen)
    truth = dense_fp32(x, weights, ids, q13, q2)

    def stacked(qs, cls):
        per = [expert_tensors(cls, q, dtype) for q in qs]
        return [torch.stack(ts).contiguous() for ts in zip(*per)]

    out = routed_experts(x, weights, ids, stacked(q13, TritonExpertKernel),
                         stacked(q2, TritonExpertKernel), TritonExpertKernel.name, group, 4)
    from vllm_subspec.draft_model.kernels import ReferenceKernel

    ref = routed_experts(x, weights, ids, stacked(q13, ReferenceKernel),
                         stacked(q2, ReferenceKernel), "reference", group, 4)
    err = lambda y: ((y.float() - truth).norm() / truth.norm()).item()  # noqa: E731
    return {"dtype": str(dtype), "shape": list(out.shape), "out_dtype": str(out.dtype),
            "finite": bool(torch.isfinite(out).all()), "rel_err": err(out),
            "reference_rel_err": err(ref)}


def main(path):
    results = {}
    for name, case in CASES.items():
        for dtype in (torch.float16, torch.bfloat16):
            results[f"{name}/{str(dtype).split('.')[-1]}"] = run_case(*case, dtype)
    with open(path, "w") as f:
        json.dump(results, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1])
