"""The offload economics of a mixture-of-experts target (a projection: no GPU ran it).

What crosses PCIe per step with each of vLLM's offload backends, for a plain decode step of one
request and a SubSpec verify of n tokens, and the acceptance τ a verify of n tokens needs to
beat plain decoding on each, from a model's shapes:

- `uva` (`--cpu-offload-gb`, vLLM's `UVAOffloader`): offloaded weights stay in pinned host
  memory and kernels read them through UVA as they compute. vLLM's fused MoE kernel
  (`fused_moe.fused_moe_kernel`, tokens grouped per expert by `moe_align_block_size`) reads an
  expert's weights only if some token is routed to it, once per block of up to BLOCK_SIZE_M
  of its tokens: a decode step reads the k routed experts, a verify of n tokens the distinct
  experts its n * k routings touch.
- `prefetch` (vLLM's `PrefetchOffloader`): each offloaded layer's parameters are copied whole
  into a GPU slot before the layer runs: every expert streams every step, plain or verify.

Distinct experts touched by n tokens: E * (1 - (1 - k/E)^n), routing taken as uniform and
independent per token (real routers are skewed, which touches fewer: this is the costly case).
Per-layer non-expert bytes (attention, router, norms) cross once per step with either backend.

    python -m benchmarks.moe_offload --name moe_offload
"""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict, dataclass

from benchmarks.depth_sweep import RESULTS

GB = 1e9


@dataclass(frozen=True)
class MoeShape:
    """A MoE checkpoint's shapes (its config.json), bf16."""
    name: str
    layers: int
    hidden: int
    experts: int
    top_k: int
    expert_intermediate: int
    q_heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    tied_embeddings: bool = False
    bytes_per_param: int = 2

    @property
    def expert_bytes(self) -> int:
        """One expert's gate, up and down projections."""
        return 3 * self.hidden * self.expert_intermediate * self.bytes_per_param

    @property
    def attention_bytes(self) -> int:
        q = self.q_heads * self.head_dim
        kv = 2 * self.kv_heads * self.head_dim
        return (self.hidden * (q + kv) + q * self.hidden) * self.bytes_per_param

    @property
    def router_bytes(self) -> int:
        return self.hidden * self.experts * self.bytes_per_param

    @property
    def layer_bytes(self) -> int:
        return self.experts * self.expert_bytes + self.attention_bytes + self.router_bytes

    @property
    def embedding_bytes(self) -> int:
        return (1 if self.tied_embeddings else 2) * self.vocab * self.hidden * self.bytes_per_param


# Qwen/Qwen3-30B-A3B's config.json: the ~30B-A3B model of the issue (about 61 GB in bf16).
QWEN3_30B_A3B = MoeShape("Qwen3-30B-A3B", layers=48, hidden=2048, experts=128, top_k=8,
                         expert_intermediate=768, q_heads=32, kv_heads=4, head_dim=128,
                         vocab=151936)
# mistralai/Mixtral-8x7B-Instruct-v0.1: few, large experts.
MIXTRAL_8X7B = MoeShape("Mixtral-8x7B", layers=32, hidden=4096, experts=8, top_k=2,
                        expert_intermediate=14336, q_heads=32, kv_heads=8, head_dim=128,
                        vocab=32000)


def experts_touched(shape: MoeShape, tokens: int) -> float:
    """Expected distinct experts n tokens route to (uniform, independent routing)."""
    e, k = shape.experts, shape.top_k
    return e * (1 - (1 - k / e) ** tokens)


def offloaded_layers(shape: MoeShape, gpu_gb: float, substitute_share: float,
                     reserve_gb: float) -> int:
    """Fewest layers in host memory so that the resident layers, the offloaded layers' 4-bit
    substitutes, the embeddings and `reserve_gb` (KV cache, activations, CUDA) fit the GPU."""
    for off in range(shape.layers + 1):
        resident = (shape.layers - off) * shape.layer_bytes
        substitutes = off * shape.layer_bytes * substitute_share
        if resident + substitutes + shape.embedding_bytes + reserve_gb * GB <= gpu_gb * GB:
            return off
    raise ValueError(f"{shape.name} does not fit {gpu_gb} GB even with every layer offloaded")


def step_bytes(shape: MoeShape, backend: str, tokens: int, offloaded: int) -> float:
    """Bytes over PCIe in one forward of `tokens` tokens (one request) with `offloaded`
    layers in host memory."""
    fixed = shape.attention_bytes + shape.router_bytes
    if backend == "prefetch":
        return offloaded * (fixed + shape.experts * shape.expert_bytes)
    return offloaded * (fixed + experts_touched(shape, tokens) * shape.expert_bytes)


def economics(shape: MoeShape, gpu_gb: float, pcie_gbps: float, substitute_share: float,
              reserve_gb: float, verify_tokens=(1, 4, 8, 16, 32, 64, 128, 289)) -> dict:
    off = offloaded_layers(shape, gpu_gb, substitute_share, reserve_gb)
    rows = []
    plain_uva = step_bytes(shape, "uva", 1, off) / (pcie_gbps * GB)
    for n in verify_tokens:
        row = {"verify_tokens": n, "experts_touched": round(experts_touched(shape, n), 1)}
        for backend in ("uva", "prefetch"):
            seconds = step_bytes(shape, backend, n, off) / (pcie_gbps * GB)
            row[f"{backend}_gb"] = round(step_bytes(shape, backend, n, off) / GB, 2)
            row[f"{backend}_s"] = round(seconds, 3)
            # tokens a verify must emit to beat plain decoding on UVA (the faster plain)
            row[f"{backend}_break_even_tau"] = round(seconds / plain_uva, 2)
        rows.append(row)
    return {"model": asdict(shape), "gpu_gb": gpu_gb, "pcie_gbps": pcie_gbps,
            "substitute_share": substitute_share, "reserve_gb": reserve_gb,
            "offloaded_layers": off, "layer_gb": round(shape.layer_bytes / GB, 3),
            "total_gb": round((shape.layers * shape.layer_bytes + shape.embedding_bytes) / GB, 1),
            "plain_uva_tok_s": round(1 / plain_uva, 2),
            "plain_prefetch_tok_s": round(pcie_gbps * GB / step_bytes(shape, "prefetch", 1, off),
                                          3),
            "rows": rows}


def markdown(reports: list[dict], command: str) -> str:
    out = ["# MoE offload economics (projection: arithmetic from shapes, no GPU ran it)", "",
           f"Command: `{command}`. Method and the vLLM code it reads: docs/moe.md.", ""]
    for r in reports:
        m = r["model"]
        out += [f"## {m['name']} ({r['total_gb']} GB bf16) on a {r['gpu_gb']:g} GB GPU, "
                f"PCIe {r['pcie_gbps']:g} GB/s", "",
                f"{r['offloaded_layers']} of {m['layers']} layers offloaded "
                f"({r['layer_gb']} GB each; their 4-bit substitutes, "
                f"{100 * r['substitute_share']:.1f}% of it, and {r['reserve_gb']:g} GB for the KV "
                f"cache and activations on the GPU). Plain decoding: "
                f"{r['plain_uva_tok_s']} tok/s with `uva`, {r['plain_prefetch_tok_s']} tok/s "
                "with `prefetch`.", "",
                "| tokens verified | experts touched per layer | uva GB | uva s | uva: τ to beat "
                "plain | prefetch GB | prefetch s | prefetch: τ to beat plain (uva) |",
                "|---|---|---|---|---|---|---|---|"]
        for row in r["rows"]:
            out.append(f"| {row['verify_tokens']} | {row['experts_touched']} | {row['uva_gb']} | "
                       f"{row['uva_s']} | {row['uva_break_even_tau']} | {row['prefetch_gb']} | "
                       f"{row['prefetch_s']} | {row['prefetch_break_even_tau']} |")
        out.append("")
    return "\n".join(out)


def main() -> None:
    import sys

    from benchmarks.plots import _pyplot
    from vllm_subspec.vllm_hooks.prefetch_plan import substitute_share

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--name", default="moe_offload")
    ap.add_argument("--pcie-gbps", type=float, default=25.0, help="measured PCIe 4 x16 copy rate")
    args = ap.parse_args()
    share = substitute_share(4, 64)
    reports = [economics(QWEN3_30B_A3B, 24.0, args.pcie_gbps, share, reserve_gb=4.0),
               economics(MIXTRAL_8X7B, 48.0, args.pcie_gbps, share, reserve_gb=6.0)]
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / f"{args.name}.json").write_text(json.dumps(reports, indent=2))
    command = "python -m benchmarks.moe_offload " + " ".join(sys.argv[1:])
    (RESULTS / f"{args.name}.md").write_text(markdown(reports, command.strip()))
    plt = _pyplot()
    fig, axes = plt.subplots(1, len(reports), figsize=(6 * len(reports), 4))
    for ax, r in zip(axes, reports):
        n = [row["verify_tokens"] for row in r["rows"]]
        for backend in ("uva", "prefetch"):
            ax.plot(n, [row[f"{backend}_break_even_tau"] for row in r["rows"]], marker="o",
                    label=backend)
        ax.plot(n, [x + 1 for x in n], ls=":", color="grey", label="τ bound (n + 1)")
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("tokens verified per step")
        ax.set_ylabel("τ needed to beat plain (uva)")
        ax.set_title(f"{r['model']['name']}, {r['gpu_gb']:g} GB GPU (projection)")
        ax.legend()
    fig.tight_layout()
    fig.savefig(RESULTS / f"{args.name}.png", dpi=100)
    print(markdown(reports, command.strip()))


if __name__ == "__main__":
    main()
