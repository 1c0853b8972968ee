"""Build a tiny causal LM and its tokenizer locally, saved with `save_pretrained`.

Nothing is downloaded. The folder loads with `AutoModelForCausalLM.from_pretrained` and
`AutoTokenizer.from_pretrained` like any hub model.

The tokenizer (`build_tokenizer`), one of three kinds:
- default: a byte-level BPE trained with `tokenizers` on text we generate (the
  arithmetic task plus common instruction words);
- ``--corpus FILE``: the same BPE trained on your own text, so the words of your task
  become stable pieces (each word splits the same way wherever it appears);
- ``--byte-level``: no merges at all: 256 byte tokens (token id = byte value) plus the
  special tokens, so every string is exactly its UTF-8 bytes. Longest sequences, but
  nothing to learn about splitting; a safe choice for a task whose text you cannot
  sample in advance.
In the BPE kinds digits always split into single tokens, so numbers are spelled out
digit by digit. ``--chat-template chatml|llama3`` adds a real-style chat template and
registers its tokens as special tokens (see `CHAT_TEMPLATES`).

The model (`model_config`), built from transformers' own config class, random weights:

    llama    LlamaConfig: RMSNorm, SwiGLU, RoPE; tied embeddings; all heads keep
             their own K/V unless --kv-heads says otherwise
    qwen2    Qwen2Config: q/k/v projections with biases, grouped-query attention
             (default: a third of the heads for K/V, as Qwen2.5's 14 heads / 2 KV
             heads), tied embeddings (as Qwen2.5-0.5B)
    mistral  MistralConfig: grouped-query attention, sliding-window attention (a
             window of max_positions / 4 tokens), untied LM head
    gemma    GemmaConfig: head_dim independent of hidden / heads (here 2 x), GELU (tanh)
             MLP, embeddings scaled by sqrt(hidden), RMSNorm (1 + w), one K/V head,
             tied embeddings

``--vocab-size`` sets the model's embedding rows. The BPE learns at most that many
tokens; when the tokenizer ends with fewer (a small corpus, --byte-level, or a
151,936-row embedding as Qwen2.5's over a 512-token tokenizer), the rows beyond it are
padding that no text maps to, as in real models (Qwen2.5's tokenizer has 151,665 tokens
for 151,936 rows).
"""

from __future__ import annotations

import argparse
import random
from pathlib import Path

from rlhflab.errors import UserError

EOS = "<|endoftext|>"
PAD = "<|pad|>"
ARCHS = ("llama", "qwen2", "mistral", "gemma")

# Chat templates written for rlhflab in the style of two real families. Each names the
# special tokens it uses; `make_tiny_model` registers them, and the generation config's
# EOS ids include the end-of-turn token.
CHAT_TEMPLATES: dict[str, dict] = {
    # ChatML, as Qwen2.5's: <|im_start|>role\ncontent<|im_end|>\n per message.
    "chatml": {
        "special_tokens": ["<|im_start|>", "<|im_end|>"],
        "end_of_turn": "<|im_end|>",
        "bos": None,
        "template": (
            "{%- for message in messages %}"
            "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
            "{%- endfor %}"
            "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
        ),
    },
    # Llama 3's: <|begin_of_text|>, then <|start_header_id|>role<|end_header_id|>\n\ncontent<|eot_id|>.
    "llama3": {
        "special_tokens": ["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"],
        "end_of_turn": "<|eot_id|>",
        "bos": "<|begin_of_text|>",
        "template": (
            "{{- bos_token }}"
            "{%- for message in messages %}"
            "{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' + message['content'] | trim + '<|eot_id|>' }}"
            "{%- endfor %}"
            "{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}"
        ),
    },
}


# --------------------------------------------------------------------------------------
# Tokenizer
# --------------------------------------------------------------------------------------
def _corpus(n: int, seed: int) -> list[str]:
    """Text for the default tokenizer: the arithmetic task plus instruction-style phrases."""
    from rlhflab.data import arith

    rng = random.Random(seed)
    lines = []
    for _ in range(n):
        row = arith.make_problem(rng)
        lines.append(f"Question: {row['question']}\nAnswer: {row['answer']}")
    extra = ("User: Assistant: the a an is are was were what how many which who why "
             "please write a short story poem answer question explain summary list "
             "good bad better worse yes no true false positive negative happy sad "
             "movie film great terrible love hate friend school teacher child kind")
    lines.extend([extra] * 20)
    return lines


def read_corpus(path: str | Path) -> list[str]:
    """The non-blank lines of a UTF-8 text file; a bad file is a one-line UserError."""
    p = Path(path).expanduser()
    if not p.is_file():
        raise UserError(f"--corpus {path}: no such file; give a UTF-8 text file of your task's text")
    from rlhflab.files import read_text

    try:
        text = read_text(p)  # a byte that is not UTF-8: its line and offset
    except UserError as exc:
        raise UserError(f"--corpus {exc} (not UTF-8 text); give a plain text file, or use --byte-level") from None
    lines = [line for line in text.splitlines() if line.strip()]
    if not lines:
        raise UserError(f"--corpus {path}: the file has no text; give a file with your task's text, one "
                        "example per line")
    return lines


def _specials(chat_template: str) -> tuple[list[str], dict | None]:
    if chat_template in (None, "none"):
        return [EOS, PAD], None
    if chat_template not in CHAT_TEMPLATES:
        raise UserError(f"--chat-template {chat_template!r}: choose one of none, {', '.join(CHAT_TEMPLATES)}")
    spec = CHAT_TEMPLATES[chat_template]
    return [EOS, PAD, *spec["special_tokens"]], spec


def _wrap(tok, specials: list[str], spec: dict | None):
    """A PreTrainedTokenizerFast around a `tokenizers` object, with the chat template."""
    from transformers import PreTrainedTokenizerFast

    extra = [s for s in specials if s not in (EOS, PAD)]
    bos = spec["bos"] if spec and spec["bos"] else EOS
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS, bos_token=bos, pad_token=PAD,
                                   unk_token=None, padding_side="left",
                                   **({"extra_special_tokens": extra} if extra else {}))
    if spec is not None:
        fast.chat_template = spec["template"]
    return fast


def build_tokenizer(vocab_size: int = 512, seed: int = 0, corpus: list[str] | None = None,
                    byte_level: bool = False, chat_template: str = "none"):
    """A PreTrainedTokenizerFast: byte-level BPE with single-digit tokens (trained on
    `corpus`, or on generated arithmetic text), or with `byte_level` pure UTF-8 bytes."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    specials, spec = _specials(chat_template)
    if byte_level:
        # Token id = byte value: the ByteLevel alphabet maps each byte to one printable
        # character, in byte order; no merges, so nothing is ever joined.
        alphabet = sorted(pre_tokenizers.ByteLevel.alphabet(), key=_byte_of)
        tok = Tokenizer(models.BPE(vocab={ch: i for i, ch in enumerate(alphabet)}, merges=[]))
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
        tok.decoder = decoders.ByteLevel()
        tok.add_special_tokens(specials)
        return _wrap(tok, specials, spec)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(corpus if corpus is not None else _corpus(3000, seed), trainer=trainer)
    return _wrap(tok, specials, spec)


def _byte_of(ch: str) -> int:
    """The byte a ByteLevel alphabet character stands for (GPT-2's bytes_to_unicode)."""
    code = ord(ch)
    printable = (list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
                 + list(range(ord("®"), ord("ÿ") + 1)))
    if code in printable:
        return code
    others = [b for b in range(256) if b not in printable]
    return others[code - 256]


# --------------------------------------------------------------------------------------
# Model
# --------------------------------------------------------------------------------------
def default_kv_heads(arch: str, num_heads: int) -> int:
    """K/V heads when --kv-heads is not given: all (llama), one (gemma), or the largest
    divisor of the heads that is at most a third of them (qwen2, mistral; 1 for <= 5 heads)."""
    if arch == "llama":
        return num_heads
    if arch == "gemma":
        return 1
    return max(d for d in range(1, num_heads + 1) if num_heads % d == 0 and 3 * d <= max(num_heads, 3))


def model_config(arch: str, tokenizer, vocab_size: int, hidden_size: int, num_layers: int, num_heads: int,
                 kv_heads: int | None = None, max_positions: int = 256):
    """The transformers config of a tiny `arch` model; see the module docstring for each."""
    from transformers import GemmaConfig, LlamaConfig, MistralConfig, Qwen2Config

    kv = kv_heads or default_kv_heads(arch, num_heads)
    common = dict(
        vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=hidden_size * 4,
        num_hidden_layers=num_layers, num_attention_heads=num_heads, num_key_value_heads=kv,
        max_position_embeddings=max_positions, bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
    )
    if arch == "llama":
        return LlamaConfig(**common, tie_word_embeddings=True)
    if arch == "qwen2":
        return Qwen2Config(**common, tie_word_embeddings=True)
    if arch == "mistral":
        return MistralConfig(**common, tie_word_embeddings=False, sliding_window=max(16, max_positions // 4))
    if arch == "gemma":
        return GemmaConfig(**common, head_dim=2 * hidden_size // num_heads, hidden_act="gelu_pytorch_tanh",
                           tie_word_embeddings=True)
    raise UserError(f"--arch {arch!r}: choose one of {', '.join(ARCHS)}")


def check_sizes(arch: str, hidden_size: int, num_heads: int, kv_heads: int | None, vocab_size: int) -> None:
    """One-line errors for sizes the architectures cannot take."""
    if arch not in ARCHS:
        raise UserError(f"--arch {arch!r}: choose one of {', '.join(ARCHS)}")
    if num_heads < 1 or hidden_size < 1:
        raise UserError("--hidden-size and --heads must be positive")
    if hidden_size % num_heads:
        raise UserError(f"--hidden-size {hidden_size} is not divisible by --heads {num_heads}")
    if (hidden_size // num_heads) % 2:
        raise UserError(f"--hidden-size / --heads = {hidden_size // num_heads} is odd; rotary embeddings need "
                        "an even head size: change --hidden-size or --heads")
    if kv_heads is not None and (kv_heads < 1 or num_heads % kv_heads):
        raise UserError(f"--kv-heads {kv_heads} must divide --heads {num_heads} (e.g. 1 or {num_heads})")
    if vocab_size < 1:
        raise UserError(f"--vocab-size {vocab_size} must be positive")


def make_tiny_model(out_dir: str | Path, hidden_size: int = 192, num_layers: int = 4,
                    num_heads: int = 6, vocab_size: int = 512, max_positions: int = 256,
                    seed: int = 0, arch: str = "llama", kv_heads: int | None = None,
                    corpus: list[str] | None = None, byte_level: bool = False,
                    chat_template: str = "none") -> Path:
    """Build and save a tiny causal LM (about 2-3M parameters at the defaults) and its
    tokenizer to `out_dir`; see the module docstring for the options."""
    import torch
    from transformers import AutoModelForCausalLM

    check_sizes(arch, hidden_size, num_heads, kv_heads, vocab_size)
    tokenizer = build_tokenizer(vocab_size, seed, corpus, byte_level, chat_template)
    if len(tokenizer) > vocab_size:
        raise UserError(f"--vocab-size {vocab_size} is smaller than the tokenizer's {len(tokenizer)} tokens "
                        f"(256 bytes + {len(tokenizer) - 256} special); raise it to at least {len(tokenizer)}")
    config = model_config(arch, tokenizer, vocab_size, hidden_size, num_layers, num_heads, kv_heads, max_positions)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config)
    gen = model.generation_config
    gen.pad_token_id, gen.bos_token_id = tokenizer.pad_token_id, tokenizer.bos_token_id
    gen.eos_token_id = tokenizer.eos_token_id
    if chat_template not in (None, "none"):
        # Generation stops at the end-of-turn token too, as in the real models' configs.
        eot = tokenizer.convert_tokens_to_ids(CHAT_TEMPLATES[chat_template]["end_of_turn"])
        gen.eos_token_id = [tokenizer.eos_token_id, eot]
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    from rlhflab.models.checkpoint import usual_modes

    usual_modes(out)  # model.safetensors 0644 like the rest, not safetensors' 0600
    return out


# --------------------------------------------------------------------------------------
# CLI
# --------------------------------------------------------------------------------------
def add_parser(parser: argparse.ArgumentParser) -> None:
    from rlhflab.cliargs import count, seed

    parser.add_argument("--out", default="outputs/tiny-model", help="output folder (default: %(default)s)")
    parser.add_argument("--arch", choices=ARCHS, default="llama",
                        help="architecture, from transformers' own config class (default: %(default)s); "
                             "qwen2: q/k/v biases, grouped-query attention, tied embeddings; mistral: "
                             "grouped-query and sliding-window attention; gemma: wide heads, GELU, scaled "
                             "embeddings, one K/V head")
    parser.add_argument("--hidden-size", type=count(), default=192,
                        help="hidden size, a multiple of --heads (default: %(default)s)")
    parser.add_argument("--layers", type=count(), default=4, help="decoder layers (default: %(default)s)")
    parser.add_argument("--heads", type=count(), default=6, help="attention heads (default: %(default)s)")
    parser.add_argument("--kv-heads", type=count(), default=None,
                        help="key/value heads, a divisor of --heads (default: all heads for llama, 1 for gemma, "
                             "about a third of them for qwen2 and mistral)")
    parser.add_argument("--vocab-size", type=count(), default=512,
                        help="embedding rows; the BPE learns at most this many tokens and rows beyond the "
                             "tokenizer are padding, as in real models (default: %(default)s; 151936 is Qwen2.5's)")
    parser.add_argument("--max-positions", type=count(2), default=256, help="longest sequence (default: %(default)s)")
    parser.add_argument("--corpus", default=None, metavar="FILE",
                        help="train the tokenizer's BPE on this UTF-8 text file (your task's text) instead of "
                             "the built-in arithmetic text (default: built-in)")
    parser.add_argument("--byte-level", action="store_true",
                        help="a pure byte tokenizer: 256 byte tokens + special tokens, no merges; every "
                             "string is its UTF-8 bytes (default: off, BPE)")
    parser.add_argument("--chat-template", choices=["none", *CHAT_TEMPLATES], default="none",
                        help="give the tokenizer a chat template and register its tokens as special: chatml "
                             "(<|im_start|>/<|im_end|>, Qwen-like) or llama3 (<|start_header_id|>, "
                             "<|eot_id|>); generation also stops at the end-of-turn token (default: %(default)s)")
    parser.add_argument("--seed", type=seed(), default=0,
                        help="seed of the weights and built-in text (default: %(default)s)")


# What make-tiny writes: a folder holding only these is an earlier tiny model, rebuilt in place.
TINY_FILES = frozenset({"config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
                        "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja"})


def refuse_occupied(out: Path) -> None:
    """make-tiny writes random weights: never into a folder that holds anything else (a run's
    metrics.jsonl and final/, another model), where they would pass for a trained model."""
    if not out.exists():
        return
    if not out.is_dir():
        raise UserError(f"--out {out}: a file, not a folder; give a new or empty folder")
    other = sorted(p.name for p in out.iterdir() if p.name not in TINY_FILES or not p.is_file())
    if other:
        shown = ", ".join(other[:4]) + (", ..." if len(other) > 4 else "")
        raise UserError(f"--out {out} is not empty (it holds {shown}); make-tiny writes a random model, so give a "
                        f"new or empty folder")


def run(args: argparse.Namespace) -> int:
    if args.corpus and args.byte_level:
        raise UserError("--corpus and --byte-level exclude each other: a byte tokenizer learns nothing from text")
    check_sizes(args.arch, args.hidden_size, args.heads, args.kv_heads, args.vocab_size)
    refuse_occupied(Path(args.out))
    corpus = read_corpus(args.corpus) if args.corpus else None
    path = make_tiny_model(args.out, args.hidden_size, args.layers, args.heads, args.vocab_size,
                           max_positions=args.max_positions, seed=args.seed, arch=args.arch,
                           kv_heads=args.kv_heads, corpus=corpus, byte_level=args.byte_level,
                           chat_template=args.chat_template)
    print(f"tiny model saved to {path}")
    return 0
