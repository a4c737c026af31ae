"""A stand-in for a loaded vLLM decoder, for substitute tests: `model.model.layers[i]` with the
four fused linears SubSpec substitutes (`self_attn.qkv_proj/o_proj`, `mlp.gate_up_proj/down_proj`)
and an input norm, in bf16; an `lm_head` whose rows are padded past the vocabulary, as vLLM's
ParallelLMHead pads them, and vLLM's own `LogitsProcessor`."""

import torch
from torch import nn


class _Attn(nn.Module):
    def __init__(self, h, qkv_bias):
        super().__init__()
        self.qkv_proj = nn.Linear(h, 3 * h, bias=qkv_bias, dtype=torch.bfloat16)
        self.o_proj = nn.Linear(h, h, bias=False, dtype=torch.bfloat16)


class _Mlp(nn.Module):
    def __init__(self, h):
        super().__init__()
        self.gate_up_proj = nn.Linear(h, 4 * h, bias=False, dtype=torch.bfloat16)
        self.down_proj = nn.Linear(2 * h, h, bias=False, dtype=torch.bfloat16)


class _Layer(nn.Module):
    def __init__(self, h, qkv_bias):
        super().__init__()
        self.self_attn, self.mlp = _Attn(h, qkv_bias), _Mlp(h)
        self.input_layernorm = nn.LayerNorm(h, dtype=torch.bfloat16)


def decoder_stub(num_layers: int = 2, h: int = 128, qkv_bias: bool = False,
                 seed: int | None = None, vocab: int = 250, padded_vocab: int = 256,
                 soft_cap: float | None = None) -> nn.Module:
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers.logits_processor import LogitsProcessor

    if seed is not None:
        torch.manual_seed(seed)
    model = nn.Module()
    model.model = nn.Module()
    model.model.layers = nn.ModuleList([_Layer(h, qkv_bias) for _ in range(num_layers)])
    model.lm_head = nn.Linear(h, padded_vocab, bias=False, dtype=torch.bfloat16)
    with set_current_vllm_config(VllmConfig()):
        model.logits_processor = LogitsProcessor(padded_vocab, vocab, soft_cap=soft_cap)
    return model
