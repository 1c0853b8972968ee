"""Multi-turn environments: loading (as reward plug-ins are), the protocol's checks as
one-line errors, the preflight, and the episode runner with a scripted fake `generate` on
tiny models' chat templates (ChatML, Llama 3) and on SmolLM2's: the action mask covers
exactly the generated ids, the context decodes to exactly the template's rendering of the
environment's messages, and the fake model's ids are kept unchanged."""

from __future__ import annotations

import re
import time
from pathlib import Path

import pytest
import torch

from rlhflab.envs import EnvConfig, EnvError, Generated, collate_episodes, preflight_env, run_episodes, setup_episodes
from rlhflab.envs.render import ChatRenderer
from rlhflab.models.tiny import build_tokenizer
from rlhflab.ops.multiturn import gae_over_actions, place_turn_rewards

ENV_PY = '''
import re
import time
from rlhflab.envs import StepResult


class Guess:
    """Guess the secret number; 'higher'/'lower' after a wrong guess, reward 1 when right."""

    def __init__(self, low=1, high=10):
        self.low, self.high = low, high

    def reset(self, example):
        self.secret = int(example["secret"])
        return [{"role": "user", "content": f"Game {example['game']}: guess my number from {self.low} to {self.high}."}]

    def step(self, messages, assistant_text):
        assert messages[-1] == {"role": "assistant", "content": assistant_text}
        m = re.search(r"-?\\d+", assistant_text)
        if m is None:
            return StepResult([{"role": "user", "content": "Say a number."}], 0.0, False)
        g = int(m.group())
        if g == self.secret:
            return StepResult(None, 1.0, True)
        return StepResult([{"role": "user", "content": "higher" if g < self.secret else "lower"}], -0.1, False)


class Raises(Guess):
    def step(self, messages, assistant_text):
        return {"x": 1}["y"]


class WrongType(Guess):
    def step(self, messages, assistant_text):
        return {"messages": None, "reward": 1.0}


class NothingToSay(Guess):
    def step(self, messages, assistant_text):
        return (None, 0.0, False)


class NanReward(Guess):
    def step(self, messages, assistant_text):
        return (None, float("nan"), True)


class SpeaksAsAssistant(Guess):
    def step(self, messages, assistant_text):
        return ([{"role": "assistant", "content": "I win"}], 0.0, False)


class Slow(Guess):
    def step(self, messages, assistant_text):
        time.sleep(5)


class BadReset(Guess):
    def reset(self, example):
        return "hello"


class NoStep:
    def reset(self, example):
        return []
'''

TOOLS_PY = '''
def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: the first
        b: the second
    """
    return a + b
'''


@pytest.fixture
def plugin_dir(tmp_path, monkeypatch):
    """The plug-ins beside a config file in another folder; the cwd elsewhere (no PYTHONPATH)."""
    cfg_dir = tmp_path / "task"
    cfg_dir.mkdir()
    (cfg_dir / "guess_env_t.py").write_text(ENV_PY)
    (cfg_dir / "add_tool_t.py").write_text(TOOLS_PY)
    monkeypatch.chdir(tmp_path)
    return cfg_dir


def cfg_for(plugin_dir: Path, name: str | None = "guess_env_t:Guess", **kw) -> EnvConfig:
    return EnvConfig(name=name, plugin_dir=str(plugin_dir), **kw)


ROW = {"prompt": "unused", "secret": 7, "game": 0, "answer": "7"}


# --------------------------------------------------------------------------------------
# Protocol checks and preflight
# --------------------------------------------------------------------------------------
def test_preflight_runs_one_canned_episode(plugin_dir, capsys):
    out = preflight_env(cfg_for(plugin_dir), ROW)
    assert (out.turns, out.rewards, out.done) == (1, [1.0], True)   # the canned reply "7" is right
    assert "preflight: env guess_env_t:Guess with reply '7': 1 turn(s), rewards [1.0], done" in capsys.readouterr().out
    # A wrong canned reply: lower, lower, lower at max_turns=3; said, not an error.
    out = preflight_env(cfg_for(plugin_dir, max_turns=3), dict(ROW, answer="9"), quiet=True)
    assert (out.turns, out.rewards, out.done) == (3, [-0.1] * 3, False)
    assert [m["content"] for m in out.messages if m["role"] == "user"][1:] == ["lower"] * 3
    assert "not done at max_turns=3" in out.line()


@pytest.mark.parametrize("name,match", [
    ("guess_env_t:Raises", r"step\(\) raised KeyError: 'y' at guess_env_t.py:\d+ on the reply '7'; fix step"),
    ("guess_env_t:WrongType", r"step\(\) returned dict .*return StepResult\(messages or None, reward, done\)"),
    ("guess_env_t:NothingToSay", "done=False with no messages, so the model has nothing new to answer"),
    ("guess_env_t:NanReward", "reward nan; return a finite number"),
    ("guess_env_t:SpeaksAsAssistant", "has role 'assistant'; an environment speaks as user, tool, system"),
    ("guess_env_t:BadReset", r"reset\(\) returned messages of type str"),
    ("guess_env_t:NoStep", r"has no step\(\) method"),
    ("guess_env_t:Nope", "has no 'Nope'"),
    ("missing_env_t:Guess", "no module 'missing_env_t'"),
])
def test_bad_environments_are_one_line_errors(plugin_dir, name, match):
    with pytest.raises(EnvError, match=match) as err:
        preflight_env(cfg_for(plugin_dir, name=name), ROW, quiet=True)
    assert "\n" not in str(err.value)
    assert name in str(err.value)


def test_a_step_past_its_timeout_is_an_error(plugin_dir):
    start = time.monotonic()
    with pytest.raises(EnvError, match=r"step\(\) took longer than env.step_timeout_s=0.2 s; make it faster"):
        preflight_env(cfg_for(plugin_dir, name="guess_env_t:Slow", step_timeout_s=0.2), ROW, quiet=True)
    assert time.monotonic() - start < 2


# Hides every assistant message but the last (as templates that drop earlier reasoning do).
REWRITING_TEMPLATE = (
    "{%- for message in messages %}{%- set c = message['content'] if message['role'] != 'assistant' or loop.last "
    "else '...' %}{{- '<|im_start|>' + message['role'] + '\\n' + c + '<|im_end|>\\n' }}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}")


def test_preflight_with_the_tokenizer_checks_the_template(plugin_dir, tiny_tokenizers):
    out = preflight_env(cfg_for(plugin_dir, max_turns=2), dict(ROW, answer="3"), tokenizer=tiny_tokenizers["chatml"],
                        quiet=True)
    assert out.turns == 2
    tok = build_tokenizer(chat_template="chatml")
    tok.chat_template = REWRITING_TEMPLATE
    with pytest.raises(EnvError, match="re-renders earlier turns"):
        preflight_env(cfg_for(plugin_dir, max_turns=2), dict(ROW, answer="3"), tokenizer=tok, quiet=True)


def test_bad_settings_refused(plugin_dir):
    with pytest.raises(EnvError, match="env.max_turns: must be an integer >= 1"):
        preflight_env(cfg_for(plugin_dir, max_turns=0), ROW, quiet=True)


def test_env_found_by_file_path_and_kwargs(plugin_dir):
    out = preflight_env(cfg_for(plugin_dir, name="guess_env_t.py:Guess", kwargs={"low": 3, "high": 4}), ROW,
                        quiet=True)
    assert out.messages[0]["content"] == "Game 0: guess my number from 3 to 4."


# --------------------------------------------------------------------------------------
# Episodes with a scripted fake model
# --------------------------------------------------------------------------------------
class FakeModel:
    """Answers 'Game k' with SCRIPT[k][turn]; returns the reply's ids, the end-of-turn id and
    two ids of junk after it (a backend may sample past the stop); records what it made."""

    def __init__(self, tok, eot: int, script: dict[int, list[str]], close: bool = True):
        self.tok, self.eot, self.script, self.close = tok, eot, script, close
        self.made: dict[int, list[list[int]]] = {k: [] for k in script}
        self.prompts: list[list[int]] = []

    def __call__(self, prompts):
        outs = []
        for p in prompts:
            self.prompts.append(list(p))
            text = self.tok.decode(p)
            game = int(re.search(r"Game (\d+)", text).group(1))
            turn = len(self.made[game])
            ids = self.tok(self.script[game][turn], add_special_tokens=False)["input_ids"]
            ids = ids + ([self.eot] if self.close else [])
            self.made[game].append(list(ids))
            outs.append(Generated(ids + [self.eot, ids[0]], [-0.5] * (len(ids) + 2)))
        return outs


def runs(mask: list[int], value: int, ids: list[int]) -> list[list[int]]:
    """The maximal runs of ids where mask == value."""
    out, cur = [], []
    for m, t in zip(mask, ids):
        if m == value:
            cur.append(t)
        elif cur:
            out, cur = out + [cur], []
    return out + ([cur] if cur else [])


SCRIPT = {0: ["I guess 5.", "Then 8.", "7"], 1: ["2", "1"], 2: ["no idea", "3", "6", "4"]}
ROWS = [{"prompt": "", "secret": 7, "game": 0}, {"prompt": "", "secret": 1, "game": 1},
        {"prompt": "", "secret": 9, "game": 2}]


def check_episode_tokens(tok, ep, made: list[list[int]]):
    """The three promises: mask 1 on exactly the generated ids (kept unchanged), and mask 0
    parts decoding to exactly the template's rendering of the environment's messages."""
    assert runs(ep.action_mask, 1, ep.ids) == made
    assert len(ep.action_mask) == len(ep.ids) and ep.turn_ends[-1] == len(ep.ids) - 1
    for end, ids in zip(ep.turn_ends, made):
        assert ep.action_mask[end] == 1 and ep.ids[end] == ids[-1]
    # The opening is the template's rendering of reset()'s messages with the generation prompt.
    msgs = ep.messages
    n_open = next(i for i, m in enumerate(msgs) if m["role"] == "assistant")
    assert tok.decode(ep.prompt_ids) == tok.apply_chat_template(msgs[:n_open], tokenize=False,
                                                                add_generation_prompt=True)
    # Each context part: the template's text after the assistant's turn up to the next one.
    assistant_at = [i for i, m in enumerate(msgs) if m["role"] == "assistant"]
    expected = []
    for a, b in zip(assistant_at, assistant_at[1:]):
        before = tok.apply_chat_template(msgs[:a + 1], tokenize=False)
        after = tok.apply_chat_template(msgs[:b], tokenize=False, add_generation_prompt=True)
        eot = tok.convert_ids_to_tokens(made[0][-1])
        expected.append(before[before.rindex(eot) + len(eot):] + after[len(before):])
    assert [tok.decode(part) for part in runs(ep.action_mask, 0, ep.ids)] == expected
    # And the whole sequence is the template's rendering of the conversation (up to the
    # template's glue after the last end-of-turn token, which the episode never needed).
    whole = tok.apply_chat_template(msgs, tokenize=False)
    text = tok.decode(ep.prompt_ids + ep.ids)
    assert whole.startswith(text) and whole[len(text):] in ("", "\n")


@pytest.fixture(scope="module")
def tiny_tokenizers():
    return {s: build_tokenizer(chat_template=s) for s in ("chatml", "llama3")}


@pytest.mark.parametrize("style", ["chatml", "llama3"])
def test_episodes_on_tiny_templates(plugin_dir, tiny_tokenizers, style):
    tok = tiny_tokenizers[style]
    setup = setup_episodes(cfg_for(plugin_dir), tok)
    model = FakeModel(tok, setup.renderer.end_of_turn_id, SCRIPT)
    eps = run_episodes(setup, ROWS, model, max_turns=3, stop_ids=[tok.eos_token_id])
    for ep, k in zip(eps, range(3)):
        check_episode_tokens(tok, ep, model.made[k])
    # Each prompt the model saw was the episode's sequence so far, never re-tokenised.
    game0 = [p for p in model.prompts if b"Game 0" in tok.decode(p).encode()]
    third_turn_starts = eps[0].turn_ends[2] + 1 - len(model.made[0][2])
    assert game0[2] == eps[0].prompt_ids + eps[0].ids[:third_turn_starts]
    # Game 0: 5 (higher), 8 (lower), 7 (right). Game 1: 2 (lower), 1 (right). Game 2: no number,
    # 3 (higher), 6 (higher), then max_turns=3.
    assert [ep.turn_rewards for ep in eps] == [[-0.1, -0.1, 1.0], [-0.1, 1.0], [0.0, -0.1, -0.1]]
    assert [(ep.done, ep.hit_max_turns, ep.hit_limit) for ep in eps] == [(True, False, False), (True, False, False),
                                                                         (False, True, False)]
    assert [m["content"] for m in eps[2].messages if m["role"] == "user"] == \
        ["Game 2: guess my number from 1 to 10.", "Say a number.", "higher"]  # the 3rd answer is never shown

    batch = collate_episodes(eps, tok.pad_token_id)
    b, t = batch.response_ids.shape
    assert b == 3 and t == max(len(e.ids) for e in eps) and batch.turn_rewards.shape == (3, 3)
    for row, ep in enumerate(eps):
        k = len(ep.ids)
        assert batch.response_ids[row, :k].tolist() == ep.ids
        assert batch.response_mask[row, :k].tolist() == ep.action_mask and batch.response_mask[row, k:].sum() == 0
        assert batch.response_attention_mask[row].tolist() == [1] * k + [0] * (t - k)
        p = len(ep.prompt_ids)  # prompts end at the last column
        assert batch.prompt_ids[row, -p:].tolist() == ep.prompt_ids and batch.prompt_mask[row].sum() == p
        # The sampler's log-probs on actions only.
        assert batch.sample_logprobs[row, :k].tolist() == [-0.5 * m for m in ep.action_mask]
    assert batch.num_turns.tolist() == [3, 2, 3] and batch.turn_mask.tolist() == [[1, 1, 1], [1, 1, 0], [1, 1, 1]]
    assert batch.hit_max_turns.tolist() == [False, False, True]
    # The turn rewards land on each turn's end-of-turn token, and GAE runs over the actions.
    rewards = place_turn_rewards(batch.turn_rewards, batch.turn_ends, batch.turn_mask, t)
    ends = batch.turn_ends[0]
    assert (batch.response_ids[0, ends] == setup.renderer.end_of_turn_id).all()  # each turn's own end-of-turn id
    assert rewards[0, ends].tolist() == pytest.approx([-0.1, -0.1, 1.0]) and rewards[0].abs().sum() == \
        pytest.approx(1.2)
    adv = gae_over_actions(rewards, torch.zeros(b, t), batch.response_mask, 1.0, 1.0).advantages
    # γ = λ = 1, V = 0: every action token of game 0 sees the return from its position on:
    # turn 1: −0.1 − 0.1 + 1 = 0.8, turn 2: 0.9, turn 3: 1.0.
    per_turn = [adv[0, e].item() for e in eps[0].turn_ends]
    assert per_turn == pytest.approx([0.8, 0.9, 1.0])


def smollm2_tokenizer(request):
    from transformers import AutoTokenizer

    local = Path(__file__).resolve().parents[1] / "outputs/models/smollm2-135m-instruct"
    folder = local if (local / "tokenizer.json").is_file() else request.getfixturevalue("smollm2_dir")
    return AutoTokenizer.from_pretrained(str(folder))


def test_episodes_on_smollm2_template(plugin_dir, request):
    tok = smollm2_tokenizer(request)
    setup = setup_episodes(cfg_for(plugin_dir), tok)
    assert setup.renderer.end_of_turn == "<|im_end|>"
    model = FakeModel(tok, setup.renderer.end_of_turn_id, SCRIPT)
    eps = run_episodes(setup, ROWS, model, max_turns=4, stop_ids=[tok.eos_token_id])
    for k, ep in enumerate(eps):
        check_episode_tokens(tok, ep, model.made[k])
    # SmolLM2's template adds its own system message before the first user message.
    assert tok.decode(eps[0].prompt_ids).startswith("<|im_start|>system\nYou are a helpful AI assistant")
    # Context between turns is "\n<|im_start|>user\nhigher<|im_end|>\n<|im_start|>assistant\n".
    assert tok.decode(runs(eps[0].action_mask, 0, eps[0].ids)[0]) == \
        "\n<|im_start|>user\nhigher<|im_end|>\n<|im_start|>assistant\n"
    # Game 2 at max_turns=4: no number, 3, 6, then 4 (higher each time): not done.
    assert eps[2].num_turns == 4 and eps[2].hit_max_turns and eps[2].turn_rewards == [0.0, -0.1, -0.1, -0.1]


def test_tool_episode_plain_form(plugin_dir, tiny_tokenizers):
    tok = tiny_tokenizers["chatml"]
    # No env.name: the tool-use environment; ChatML's tiny template does not render tools,
    # so the format is plain and a system message describes the tool.
    setup = setup_episodes(cfg_for(plugin_dir, name=None, tools=["add_tool_t:add"]), tok)
    assert setup.tool_format == "plain" and "add(a: integer, b: integer)" in setup.system_prompt
    script = {0: ["CALL add(a=2, b=3)", "CALL add(a=2)\nCALL sub(a=1)", "It is 5."]}
    model = FakeModel(tok, setup.renderer.end_of_turn_id, script)
    (ep,) = run_episodes(setup, [{"prompt": "Game 0: what is 2 + 3?"}], model, max_turns=4)
    check_episode_tokens(tok, ep, model.made[0])
    assert [m["role"] for m in ep.messages] == ["system", "user", "assistant", "tool", "assistant", "tool", "tool",
                                                "assistant"]
    tools_said = [m["content"] for m in ep.messages if m["role"] == "tool"]
    assert tools_said[0] == "5" and tools_said[1].startswith("error: bad arguments for add")
    assert tools_said[2] == "error: unknown tool 'sub'; the tools are: add"
    assert (ep.tool_calls, ep.tool_errors, ep.num_turns, ep.done) == (3, 2, 3, True)
    assert ep.turn_rewards == [0.0, 0.0, 0.0]


HERMES_TEMPLATE = (
    "{%- if tools %}{{- '<|im_start|>system\\nTools:' }}{%- for t in tools %}{{- '\\n' + t | tojson }}{%- endfor %}"
    "{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message['role'] == 'tool' %}{{- '<|im_start|>user\\n<tool_response>\\n' + message['content'] + "
    "'\\n</tool_response><|im_end|>\\n' }}"
    "{%- else %}{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}{%- endif %}"
    "{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}")


def test_tool_episode_hermes_form_with_a_tool_template(plugin_dir):
    tok = build_tokenizer(chat_template="chatml")
    tok.chat_template = HERMES_TEMPLATE  # renders the tools' schemas: auto picks hermes
    setup = setup_episodes(cfg_for(plugin_dir, name=None, tools=["add_tool_t.py:add"]), tok)
    assert setup.tool_format == "hermes" and setup.system_prompt is None
    call = '<tool_call>{"name": "add", "arguments": {"a": 40, "b": 2}}</tool_call>'
    model = FakeModel(tok, setup.renderer.end_of_turn_id, {0: [call, "42"]})
    (ep,) = run_episodes(setup, [{"prompt": "Game 0: 40 + 2?"}], model, max_turns=4)
    assert '"name": "add"' in tok.decode(ep.prompt_ids)  # the schema is in the opening
    (ctx,) = runs(ep.action_mask, 0, ep.ids)
    assert tok.decode(ctx) == "\n<|im_start|>user\n<tool_response>\n42\n</tool_response><|im_end|>\n" \
                              "<|im_start|>assistant\n"
    assert (ep.tool_calls, ep.tool_errors, ep.num_turns) == (1, 0, 2)


def test_truncated_turn_and_max_length(plugin_dir, tiny_tokenizers):
    tok = tiny_tokenizers["chatml"]
    setup = setup_episodes(cfg_for(plugin_dir), tok)
    # A turn with no end-of-turn token (out of tokens) ends the episode: hit_limit.
    model = FakeModel(tok, setup.renderer.end_of_turn_id, {0: ["I guess"]}, close=False)
    model_out = model.__call__

    def no_eot(prompts):
        return [Generated(g.ids[:-2]) for g in model_out(prompts)]  # no end-of-turn id, no junk

    (ep,) = run_episodes(setup, [ROWS[0]], no_eot, max_turns=3)
    assert ep.hit_limit and ep.num_turns == 1 and ep.ids == model.made[0][0]
    assert ep.sample_logprobs is None  # the backend gave none
    # max_length: the budget is never passed, and the last real token is an action.
    model = FakeModel(tok, setup.renderer.end_of_turn_id, SCRIPT)
    budget = len(setup.renderer.prompt([{"role": "user", "content": "Game 0: guess my number from 1 to 10."}])[1]) + 20
    (ep,) = run_episodes(setup, [ROWS[0]], model, max_turns=3, max_length=budget)
    assert len(ep.prompt_ids) + len(ep.ids) <= budget and ep.action_mask[-1] == 1
    assert ep.hit_max_length and ep.num_turns < 3


def test_template_that_rewrites_earlier_turns_is_refused(plugin_dir):
    tok = build_tokenizer(chat_template="chatml")
    tok.chat_template = REWRITING_TEMPLATE
    setup = setup_episodes(cfg_for(plugin_dir), tok)
    model = FakeModel(tok, setup.renderer.end_of_turn_id, SCRIPT)
    with pytest.raises(EnvError, match="re-renders earlier turns when a message is added"):
        run_episodes(setup, [ROWS[0]], model, max_turns=3)


def test_tokenizer_without_template_refused():
    with pytest.raises(EnvError, match="need a chat template.*--chat-template chatml"):
        ChatRenderer(build_tokenizer())


def test_a_one_turn_episode_is_laid_out_as_a_single_turn_rollout(plugin_dir, tiny_tokenizers):
    """A one-turn episode's tensors equal what the single-turn rollout builds from the same
    prompt text and the same sampled ids (`finish_rollout`): phase 2's bit-for-bit parity."""
    from rlhflab.config.schema import DatasetConfig
    from rlhflab.data.prompts import load_prompts
    from rlhflab.rollout import finish_rollout

    tok = tiny_tokenizers["chatml"]
    one_turn = plugin_dir / "one_turn_t.py"
    one_turn.write_text("class OneTurn:\n    def reset(self, example):\n"
                        "        return [{'role': 'user', 'content': example['prompt']}]\n"
                        "    def step(self, messages, text):\n        return None, float(len(text)), True\n")
    rows = plugin_dir / "rows.jsonl"
    rows.write_text('{"question": "Game 0: 2 + 2?", "answer": "4"}\n{"question": "Game 1: 10 - 3?", "answer": "7"}\n')
    # The single-turn prompt text: the dataset's prompt through the chat template.
    examples = load_prompts(DatasetConfig(path=str(rows)), tok, "train")
    plain = load_prompts(DatasetConfig(path=str(rows), use_chat_template=False), tok, "train")
    setup = setup_episodes(cfg_for(plugin_dir, name="one_turn_t:OneTurn"), tok)
    model = FakeModel(tok, setup.renderer.end_of_turn_id, {0: ["It is 4."], 1: ["7"]})
    eps = run_episodes(setup, [{"prompt": e.prompt} for e in plain], model, max_turns=3)
    batch = collate_episodes(eps, tok.pad_token_id)

    enc = tok([e.prompt for e in examples], return_tensors="pt", padding=True, add_special_tokens=False)
    assert torch.equal(enc.input_ids, batch.prompt_ids) and torch.equal(enc.attention_mask, batch.prompt_mask)
    width = max(len(g) for g in model.made[0] + model.made[1]) + 2  # what a backend returns: junk after the stop
    sampled = [m[0] + [setup.renderer.end_of_turn_id] * (width - len(m[0])) for m in (model.made[0], model.made[1])]
    roll = finish_rollout(torch.cat([enc.input_ids, torch.tensor(sampled)], 1), enc.input_ids, enc.attention_mask,
                          tok, [tok.eos_token_id, setup.renderer.end_of_turn_id], [], [])
    t = batch.response_ids.shape[1]
    assert torch.equal(roll.response_ids[:, :t], batch.response_ids) and (roll.response_mask[:, t:] == 0).all()
    assert torch.equal(roll.response_mask[:, :t], batch.response_mask)
    assert torch.equal(batch.response_mask, batch.response_attention_mask)  # one turn: no context after the prompt
    assert roll.responses == [ep.messages[-1]["content"] for ep in eps] and batch.turn_rewards[:, 0].tolist() == \
        [float(len(r)) for r in roll.responses]
