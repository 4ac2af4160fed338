"""A tiny Llama GGUF file written with ``gguf``'s own writer, so the real GGUF loading code runs
in the fast tier without the 98 MB SmolLM2 file."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import torch
from transformers import LlamaConfig, LlamaForCausalLM
from transformers.convert_slow_tokenizer import bytes_to_unicode

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
MERGES = ["h e", "l l", "he ll"]
CHATML = (
    "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def _vocab() -> list[str]:
    byte_chars = list(bytes_to_unicode().values())
    return [*SPECIALS, *byte_chars, "he", "ll", "hell"]


def _permute(weight: torch.Tensor, heads: int) -> np.ndarray:
    """llama.cpp's row order for the rotary halves of q and k (transformers undoes it)."""
    rows = weight.shape[0]
    out = weight.reshape(heads, 2, rows // heads // 2, *weight.shape[1:]).swapaxes(1, 2)
    return out.reshape(weight.shape).numpy()


def tiny_llama(vocab_size: int) -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        tie_word_embeddings=True,
    )
    return LlamaForCausalLM(config).eval()


def _write_tensors(writer: gguf.GGUFWriter, model: LlamaForCausalLM) -> None:
    cfg, sd = model.config, model.state_dict()
    writer.add_tensor("token_embd.weight", sd["model.embed_tokens.weight"].numpy())
    writer.add_tensor("output_norm.weight", sd["model.norm.weight"].numpy())
    names = {
        "input_layernorm": "attn_norm",
        "self_attn.v_proj": "attn_v",
        "self_attn.o_proj": "attn_output",
        "post_attention_layernorm": "ffn_norm",
        "mlp.gate_proj": "ffn_gate",
        "mlp.up_proj": "ffn_up",
        "mlp.down_proj": "ffn_down",
    }
    for i in range(cfg.num_hidden_layers):
        pre = f"model.layers.{i}."
        q, k = sd[pre + "self_attn.q_proj.weight"], sd[pre + "self_attn.k_proj.weight"]
        writer.add_tensor(f"blk.{i}.attn_q.weight", _permute(q, cfg.num_attention_heads))
        writer.add_tensor(f"blk.{i}.attn_k.weight", _permute(k, cfg.num_key_value_heads))
        for hf, gg in names.items():
            writer.add_tensor(f"blk.{i}.{gg}.weight", sd[f"{pre}{hf}.weight"].numpy())


def write_tiny_gguf(path: Path) -> LlamaForCausalLM:
    """Write a 2-layer Llama with a byte-level BPE tokenizer and a chat template; return the
    model whose weights the file holds."""
    vocab = _vocab()
    model = tiny_llama(len(vocab))
    cfg = model.config
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_name("tiny test llama")
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_vocab_size(len(vocab))
    writer.add_rope_dimension_count(cfg.hidden_size // cfg.num_attention_heads)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(vocab)
    writer.add_token_types([3] * len(SPECIALS) + [1] * (len(vocab) - len(SPECIALS)))
    writer.add_token_merges(MERGES)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_unk_token_id(0)
    writer.add_pad_token_id(2)
    writer.add_chat_template(CHATML)
    _write_tensors(writer, model)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return model
