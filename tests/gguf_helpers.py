"""Small GGUF files written with the `gguf` package, for the import tests.

`write_tiny_gguf` writes a one-layer Llama (16 hidden, 2 heads, float32 tensors, about
50 kB) with a byte-level BPE tokenizer (256 byte symbols, the special tokens given, one
merge) and a ChatML-style chat template: a whole GGUF file that transformers' GGUF
loader reads like a real one, in well under a second.
"""

from __future__ import annotations

from pathlib import Path

CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def write_tiny_gguf(path: Path, arch: str = "llama", specials: tuple[str, ...] = ("<|endoftext|>", "<|im_start|>",
                    "<|im_end|>"), eos_id: int = 2, chat_template: str | None = CHATML, seed: int = 0,
                    add_bos: bool | None = None) -> Path:
    import gguf
    import numpy as np
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    hidden, ff, heads = 16, 32, 2
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(1)
    w.add_context_length(64)
    w.add_embedding_length(hidden)
    w.add_feed_forward_length(ff)
    w.add_head_count(heads)
    w.add_head_count_kv(heads)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_freq_base(10000.0)
    tokens = list(specials) + list(bytes_to_unicode().values()) + ["Ġt"]
    w.add_vocab_size(len(tokens))
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types([3] * len(specials) + [1] * (len(tokens) - len(specials)))  # 3: control, 1: normal
    w.add_token_merges(["Ġ t"])
    w.add_bos_token_id(1)
    w.add_eos_token_id(eos_id)
    if add_bos is not None:
        w.add_add_bos_token(add_bos)
    if chat_template is not None:
        w.add_chat_template(chat_template)
    rng = np.random.default_rng(seed)

    def rand(name: str, shape: tuple[int, ...]) -> None:
        w.add_tensor(name, (rng.standard_normal(shape) * 0.1).astype(np.float32))

    rand("token_embd.weight", (len(tokens), hidden))
    w.add_tensor("blk.0.attn_norm.weight", np.ones(hidden, np.float32))
    for name in ("attn_q", "attn_k", "attn_v", "attn_output"):
        rand(f"blk.0.{name}.weight", (hidden, hidden))
    w.add_tensor("blk.0.ffn_norm.weight", np.ones(hidden, np.float32))
    rand("blk.0.ffn_gate.weight", (ff, hidden))
    rand("blk.0.ffn_up.weight", (ff, hidden))
    rand("blk.0.ffn_down.weight", (hidden, ff))
    w.add_tensor("output_norm.weight", np.ones(hidden, np.float32))
    rand("output.weight", (len(tokens), hidden))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
