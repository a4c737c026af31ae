"""PNG figures for the benchmark results (matplotlib, no display needed)."""

from __future__ import annotations

from pathlib import Path


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save(fig, path: Path) -> None:
    """Lay the figure out, write it as a PNG and free it."""
    plt = _pyplot()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_depth(report: dict, path: Path) -> None:
    """τ vs depth (chain vs tree) and the draft / verify share of a step per depth."""
    plt = _pyplot()
    fig, (ax_tau, ax_share) = plt.subplots(1, 2, figsize=(11, 4))
    for kind, marker in (("chain", "o"), ("tree", "s")):
        runs = sorted((r for r in report["runs"] if r["config"].startswith(kind)),
                      key=lambda r: r["depth"])
        if runs:
            ax_tau.plot([r["depth"] for r in runs], [r["tau"] for r in runs], marker=marker,
                        label=runs[0]["config"].split(":")[0] + (
                            f" (k={runs[0]['config'].split(':')[1].split('x')[0]})"
                            if kind == "tree" else " (k=1)"))
    ax_tau.set(xlabel="draft depth D", ylabel="τ (tokens per verify step)",
               title="τ vs depth")
    ax_tau.legend()
    ax_tau.grid(alpha=0.3)
    runs = sorted(report["runs"], key=lambda r: (r["config"].split(":")[0], r["depth"]))
    labels = [r["config"] for r in runs]
    draft = [r["draft_seconds_per_step"] for r in runs]
    other = [r["other_seconds_per_step"] for r in runs]
    total = [d + o or 1.0 for d, o in zip(draft, other)]
    ax_share.bar(labels, [d / t for d, t in zip(draft, total)], label="speculate (draft)")
    ax_share.bar(labels, [o / t for o, t in zip(other, total)],
                 bottom=[d / t for d, t in zip(draft, total)], label="verify + rest")
    ax_share.set(ylabel="share of step time", title="speculate vs verify (CPU)")
    ax_share.tick_params(axis="x", rotation=45)
    ax_share.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_methods(report: dict, path: Path) -> None:
    """τ and tokens/s of every method on every workload."""
    plt = _pyplot()
    results = {m: r for m, r in report["results"].items() if "skipped" not in r}
    loads = list(report["workloads"])
    fig, axes = plt.subplots(1, 2, figsize=(12, 4))
    width = 0.8 / max(len(results), 1)
    for key, ax, title in (("tau", axes[0], "τ (tokens per verify step)"),
                           ("tokens_per_second", axes[1], "tokens/s (CPU, no offload)")):
        for i, (method, res) in enumerate(results.items()):
            ax.bar([j + i * width for j in range(len(loads))], [res[w][key] for w in loads],
                   width, label=method)
        ax.set_xticks([j + 0.4 - width / 2 for j in range(len(loads))], loads)
        ax.set(title=title)
        ax.grid(axis="y", alpha=0.3)
    handles, labels = axes[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=len(labels), fontsize=8)
    fig.tight_layout(rect=(0, 0.07, 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_projection(rows: list[dict], path: Path) -> None:
    """PROJECTED speed-up vs depth for each GPU setting (a model, not a measurement)."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6.5, 4))
    settings = list(rows[0]["projected"]) if rows else []
    for kind, style in (("chain", "--"), ("tree", "-")):
        runs = sorted((r for r in rows if r["config"].startswith(kind)), key=lambda r: r["depth"])
        for s in settings:
            if runs:
                ax.plot([r["depth"] for r in runs], [r["projected"][s] for r in runs], style,
                        marker="o", label=f"{kind}, {s}")
    ax.set(xlabel="draft depth D", ylabel="PROJECTED speed-up vs plain offload",
           title="PROJECTED GPU speed-up from measured τ")
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_step_host(report: dict, path: Path) -> None:
    """Host ms per verify step vs requests (per output length, with and without penalties),
    and the draft loop's host ms per pass."""
    plt = _pyplot()
    fig, (ax_verify, ax_draft) = plt.subplots(1, 2, figsize=(11, 4))
    series = sorted({(r["output_len"], r["penalties"]) for r in report["verify"]})
    for output_len, penalties in series:
        rows = sorted((r for r in report["verify"] if r["output_len"] == output_len
                       and r["penalties"] == penalties), key=lambda r: r["batch"])
        ax_verify.plot([r["batch"] for r in rows], [r["verify_ms"] for r in rows], marker="o",
                       label=f"{output_len} tokens so far" + (", penalties" if penalties else ""))
    ax_verify.set(xlabel="requests in the step", ylabel="host ms per verify step",
                  title="verify: host work (CPU)", xscale="log")
    ax_verify.legend(fontsize=8)
    ax_verify.grid(alpha=0.3)
    draft = sorted(report["draft"], key=lambda d: d["batch"])
    ax_draft.plot([d["batch"] for d in draft], [d["ms_per_pass"] for d in draft], marker="s")
    ax_draft.set(xlabel="requests in the step", ylabel="host ms per draft pass",
                 title="draft loop: host work (CPU)", xscale="log")
    ax_draft.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_gpu_components(report: dict, path: Path) -> None:
    """scripts/gpu_components.py's GPU report: tree attention (Triton unsplit, split, torch
    SDPA) per case, and the draft pass eager vs CUDA-graph replay."""
    plt = _pyplot()
    fig, (ax_tree, ax_draft) = plt.subplots(1, 2, figsize=(12, 4.2),
                                            gridspec_kw={"width_ratios": [3, 1]})
    cases = [c for c in report["tree_attention"]["cases"] if "unsplit_ms" in c]
    labels = [f"{c['requests']}x{c['rows']}\n@{c['context'] // 1024 or c['context']}"
              f"{'k' if c['context'] >= 1024 else ''}" for c in cases]
    x = range(len(cases))
    for offset, key, name in ((-0.27, "unsplit_ms", "Triton, one split"),
                              (0.0, "split_ms", "Triton, context split"),
                              (0.27, "sdpa_ms", "torch SDPA (mask, gathered K/V)")):
        ax_tree.bar([i + offset for i in x], [c[key] for c in cases], width=0.27, label=name)
    ax_tree.set_xticks(list(x), labels, fontsize=7)
    ax_tree.set(yscale="log", ylabel="ms per layer call (bf16)",
                title="tree attention: requests x tree rows @ context")
    ax_tree.legend(fontsize=8)
    ax_tree.grid(alpha=0.3, axis="y")
    passes = report["draft_pass"]["passes"]
    rows = [str(p["rows"]) for p in passes]
    ax_draft.bar([i - 0.2 for i in range(len(passes))], [p["eager_ms"] for p in passes],
                 width=0.4, label="eager")
    ax_draft.bar([i + 0.2 for i in range(len(passes))], [p.get("graph_ms", 0) for p in passes],
                 width=0.4, label="CUDA graph")
    ax_draft.set_xticks(range(len(passes)), rows)
    ax_draft.set(xlabel="rows", ylabel="ms per draft pass",
                 title=f"{report['draft_pass']['layers']}-layer draft pass")
    ax_draft.legend(fontsize=8)
    ax_draft.grid(alpha=0.3, axis="y")
    fig.suptitle(f"GPU components on {report['env'].get('gpu')}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
