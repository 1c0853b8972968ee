"""`rlhflab make-prefs`: preference pairs for the arithmetic task without a person.

Synthetic pairs (`rlhflab.data.preferences.write_arith_pairs`: the right worked answer
against three kinds of wrong one), or, with `--policy`, the policy's own samples labelled
by a rule (`policy_pairs`): the offline stand-in for `rlhflab label generate` + labelling
+ `label export`. Either way the rows are in the labelling app's export format, with raw
prompts (the bare question): the run that reads them applies its template
(configs/rm_debug.yaml and configs/dpo_debug.yaml: "Question: {prompt}\nAnswer:";
docs/reference/data_formats.md, "Raw prompts, one template").
"""

from __future__ import annotations

from typing import Sequence

from rlhflab.data.preferences import ARITH_TEMPLATE, pairs_from_samples, write_arith_pairs
from rlhflab.errors import UserError


def policy_pairs(model, tokenizer, rows: Sequence[dict], n: int = 4, seed: int = 0,
                 template: str = ARITH_TEMPLATE, max_new_tokens: int = 16, temperature: float = 1.0,
                 batch_size: int = 64, labeller=None) -> list[dict]:
    """Preference rows from the policy's own samples, labelled by a rule (no humans).

    The offline stand-in for `rlhflab label generate` + labelling + `label export`: `n`
    responses are sampled per prompt; the `labeller(response, row) -> float` (default:
    the GSM8K checker against row["answer"]) scores each; for each prompt, the best
    distinct response is paired with the worst when their scores differ
    (`data.preferences.pairs_from_samples`). The reward
    model then learns on the distribution PPO starts from (the SFT policy's mistakes).
    The policy is sampled on `template` around each question; the rows hold the bare
    question (raw prompts: the reward model's run applies the same template).
    """
    import torch

    from rlhflab.rewards.gsm8k import gsm8k_reward
    from rlhflab.rollout import generate

    labeller = labeller or (lambda response, row: gsm8k_reward(response, str(row["answer"])))
    prompts = [template.replace("{prompt}", r["question"]) for r in rows]
    torch.manual_seed(seed)
    roll = generate(model, tokenizer, [p for p in prompts for _ in range(n)], max_new_tokens=max_new_tokens,
                    temperature=temperature, batch_size=batch_size)
    out = []
    for i, row in enumerate(rows):
        samples = list(dict.fromkeys(roll.responses[i * n : (i + 1) * n]))  # distinct, in order
        for pair in pairs_from_samples(row["question"], samples, [labeller(r, row) for r in samples]):
            out.append({**pair, "pair_id": i})
    return out


def write_policy_pairs(policy: str, data_dir, out_dir, n: int = 4, seed: int = 0,
                       n_train: int | None = None, n_test: int | None = None, **kw) -> dict:
    """Sample the policy on `data_dir`/train.jsonl and test.jsonl; write labelled pairs."""
    from pathlib import Path

    from rlhflab.data import arith
    from rlhflab.data.loading import read_rows
    from rlhflab.models.load import load_model

    model, tok = load_model(policy)
    out = Path(out_dir)
    paths = {}
    for split, limit in (("train", n_train), ("test", n_test)):
        rows = read_rows(str(Path(data_dir) / f"{split}.jsonl"))[:limit]
        pairs = policy_pairs(model, tok, rows, n, seed + (split == "test"), **kw)
        if not pairs:
            raise UserError(f"{policy}: no prompt of {split}.jsonl got both a right and a wrong sample; "
                            "raise n or use a model that is sometimes right")
        paths[split] = arith.write_jsonl(pairs, out / f"{split}.jsonl")
    return paths


def add_parser(parser) -> None:
    parser.add_argument("--out", default="outputs/prefs", help="output folder")
    parser.add_argument("--policy", default=None,
                        help="sample this model on --data's train/test questions and label its answers "
                             "with the GSM8K checker; without it, write synthetic pairs")
    parser.add_argument("--data", default="outputs/arith", help="folder with train.jsonl and test.jsonl (with --policy)")
    from rlhflab.cliargs import count, seed
    from rlhflab.data.arith import MAX_PROBLEMS

    parser.add_argument("--samples", type=count(2), default=4,
                        help="responses sampled per prompt, at least 2 to make a pair (with --policy; default: %(default)s)")
    parser.add_argument("--n-train", type=count(1, MAX_PROBLEMS), default=2000,
                        help="training pairs (synthetic) or problems sampled (with --policy; default: %(default)s)")
    parser.add_argument("--n-test", type=count(1, MAX_PROBLEMS), default=200,
                        help="held-out pairs or problems (default: %(default)s)")
    parser.add_argument("--seed", type=seed(), default=0, help="seed (default: %(default)s)")


def run(args) -> int:
    if args.policy:
        paths = write_policy_pairs(args.policy, args.data, args.out, args.samples, args.seed,
                                   args.n_train, args.n_test)
    else:
        paths = write_arith_pairs(args.out, args.n_train, args.n_test, args.seed)
    for name, path in paths.items():
        n = sum(1 for _ in open(path))
        print(f"{name:>5}: {path} ({n} pairs)")
    return 0


if __name__ == "__main__":  # python -m rlhflab.label.make_prefs --out outputs/prefs
    import argparse

    _parser = argparse.ArgumentParser(prog="python -m rlhflab.label.make_prefs",
                                      description="write arithmetic preference pairs (labelling-app format)")
    add_parser(_parser)
    raise SystemExit(run(_parser.parse_args()))
