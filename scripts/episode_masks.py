"""Draw the masks of one multi-turn episode, token by token (docs/environments.md quotes it).

A guess-the-number environment and a scripted stand-in for the model (it answers "5",
then "7"; no model is loaded) run one episode through `rlhflab.envs.run_episodes` with
SmolLM2-135M-Instruct's tokenizer and chat template. The script prints a markdown table
of the response part (every token after the opening): the token, its `action_mask`, who
wrote it, and the per-token reward after `place_turn_rewards`.

    .venv/bin/python scripts/episode_masks.py [--tokenizer FOLDER]

FOLDER defaults to outputs/models/smollm2-135m-instruct (made by `rlhflab import-gguf`
or the test suite's fixture); any folder with a chat-template tokenizer works.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from rlhflab.envs import StepResult, collate_episodes, run_episodes
from rlhflab.envs.episode import EpisodeSetup
from rlhflab.envs.render import ChatRenderer
from rlhflab.ops.multiturn import place_turn_rewards


class Guess:
    def reset(self, example):
        return [{"role": "user", "content": "Guess my number (1-9)."}]

    def step(self, messages, assistant_text):
        guess = int(assistant_text.strip() or 0)
        if guess == 7:
            return StepResult(None, 1.0, True)
        return StepResult([{"role": "user", "content": "higher" if guess < 7 else "lower"}], 0.0, False)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokenizer", default=str(Path(__file__).resolve().parents[1]
                                                   / "outputs/models/smollm2-135m-instruct"))
    args = parser.parse_args()
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(args.tokenizer)
    renderer = ChatRenderer(tok)
    replies = iter(["5", "7"])

    def generate(prompts):  # the scripted stand-in: one reply, then the end-of-turn token
        return [tok(next(replies), add_special_tokens=False)["input_ids"] + [renderer.end_of_turn_id]
                for _ in prompts]

    setup = EpisodeSetup(Guess, "Guess", [], "plain", renderer, None)
    (ep,) = run_episodes(setup, [{}], generate, max_turns=4)
    batch = collate_episodes([ep], tok.pad_token_id)
    rewards = place_turn_rewards(batch.turn_rewards, batch.turn_ends, batch.turn_mask, len(ep.ids))[0]
    print(f"opening (prompt part): {len(ep.prompt_ids)} tokens, action_mask 0, ending "
          f"{tok.decode(ep.prompt_ids[-3:])!r}")
    print()
    print("| t | token | action_mask | written by | reward |")
    print("| --- | --- | --- | --- | --- |")
    turn = 0
    for t, (i, m) in enumerate(zip(ep.ids, ep.action_mask)):
        who = f"model, turn {turn + 1}" if m else "environment (template)"
        print(f"| {t} | `{tok.decode([i])!r}` | {m} | {who} | {rewards[t].item():g} |")
        if m and t in ep.turn_ends:
            turn += 1
    print()
    print(f"turns {ep.num_turns}, turn rewards {ep.turn_rewards}, turn ends {ep.turn_ends}, done {ep.done}")


if __name__ == "__main__":
    main()
