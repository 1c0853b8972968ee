"""Build a tiny causal LM and its tokenizer locally, saved with `save_pretrained`.

Nothing is downloaded: the tokenizer is a byte-level BPE trained with `tokenizers` on
text we generate (digits always split into single tokens, so numbers are spelled out
digit by digit), and the model is a Llama-architecture decoder initialised at random
from a config. The folder loads with `AutoModelForCausalLM.from_pretrained` and
`AutoTokenizer.from_pretrained` like any hub model.
"""

from __future__ import annotations

import argparse
import random
from pathlib import Path

EOS = "<|endoftext|>"
PAD = "<|pad|>"


def _corpus(n: int, seed: int) -> list[str]:
    """Text for the tokenizer: the arithmetic task plus instruction-style phrases."""
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


def build_tokenizer(vocab_size: int = 512, seed: int = 0):
    """A byte-level BPE tokenizer with single-digit tokens, as PreTrainedTokenizerFast."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=[EOS, PAD],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(_corpus(3000, seed), trainer=trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS, bos_token=EOS,
                                   pad_token=PAD, unk_token=None, padding_side="left")


def make_tiny_model(out_dir: str | Path, hidden_size: int = 192, num_layers: int = 4,
                    num_heads: int = 6, vocab_size: int = 512, max_positions: int = 256,
                    seed: int = 0, arch: str = "llama") -> Path:
    """Build and save a tiny causal LM (about 2-3M parameters) and tokenizer to `out_dir`."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config

    out = Path(out_dir)
    tokenizer = build_tokenizer(vocab_size, seed)
    common = dict(
        vocab_size=len(tokenizer), hidden_size=hidden_size, intermediate_size=hidden_size * 4,
        num_hidden_layers=num_layers, num_attention_heads=num_heads,
        num_key_value_heads=num_heads, max_position_embeddings=max_positions,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id, tie_word_embeddings=True,
    )
    if arch == "llama":
        config = LlamaConfig(**common)
    elif arch == "qwen2":
        config = Qwen2Config(**common)
    else:
        raise ValueError(f"unknown arch {arch!r}; choose llama or qwen2")
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.bos_token_id = tokenizer.bos_token_id
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def add_parser(parser: argparse.ArgumentParser) -> None:
    from rlhflab.cliargs import count, seed

    parser.add_argument("--out", default="outputs/tiny-model", help="output folder (default: %(default)s)")
    parser.add_argument("--hidden-size", type=count(), default=192,
                        help="width of the decoder; a multiple of --heads (default: %(default)s)")
    parser.add_argument("--layers", type=count(), default=4, help="decoder layers (default: %(default)s)")
    parser.add_argument("--heads", type=count(), default=6, help="attention heads (default: %(default)s)")
    parser.add_argument("--vocab-size", type=count(), default=512,
                        help="BPE vocabulary size to train, at least the 256 bytes plus the specials "
                             "(default: %(default)s)")
    parser.add_argument("--arch", choices=["llama", "qwen2"], default="llama",
                        help="architecture of the config (default: %(default)s)")
    parser.add_argument("--seed", type=seed(), default=0, help="seed of the weights and the tokenizer "
                                                              "corpus (default: %(default)s)")


def run(args: argparse.Namespace) -> int:
    from rlhflab.errors import UserError
    if args.hidden_size % args.heads:
        raise UserError(f"--hidden-size {args.hidden_size} is not divisible by --heads {args.heads}")
    path = make_tiny_model(args.out, args.hidden_size, args.layers, args.heads,
                           args.vocab_size, seed=args.seed, arch=args.arch)
    print(f"tiny model saved to {path}")
    return 0
