"""Chat templates: the one rule for whether to use one, and the end-of-turn token.

The rule, the same for every command (`sft`, `rm`, `dpo`, `ppo`, `grpo`, `rloo`, and the
commands that only generate: `eval`, `generate`, `label generate`): the `use_chat_template`
key (``data.`` for SFT and the reward model, ``dataset.`` for the trainers,
``--use-chat-template`` for `eval`, `generate` and `label generate`) is ``auto`` by
default: the tokenizer's chat template is used when it has one, plain text templates
otherwise. ``true`` insists on a template (a tokenizer
without one is an error that says so); ``false`` never uses one.

A chat model closes its answer with an end-of-turn token (``<|im_end|>`` in ChatML,
``<|eot_id|>`` in Llama 3, ``<end_of_turn>`` in Gemma), which is not always the
tokenizer's EOS, and some hub models' generation_config leaves it out. `end_of_turn_id`
finds it from the template itself: it renders a one-turn conversation and takes the
first special token after the assistant's text. Generation stops there, the response
mask includes it (it is scored like any response token), and the decoded response text
that rewards read leaves it out (it is a special token).
"""

from __future__ import annotations

from rlhflab.errors import UserError

_MARK = "rlhflab-end-of-turn-probe"


def has_chat_template(tokenizer) -> bool:
    return bool(getattr(tokenizer, "chat_template", None))


def resolve_use_chat_template(setting: bool | str, tokenizer, key: str = "dataset.use_chat_template") -> bool:
    """The `use_chat_template` setting (true, false or "auto") as a yes/no for this tokenizer.

    `key` names the config key in the error for ``true`` on a tokenizer without a template.
    """
    if setting == "auto":
        return has_chat_template(tokenizer)
    if setting is True or setting == "true":
        if not has_chat_template(tokenizer):
            name = getattr(tokenizer, "name_or_path", "") or "the model's"
            to = " " if key.startswith("--") else "="  # a command-line option or a config key
            raise UserError(f"{key}: true, but the tokenizer {name!r} has no chat template; set {key}{to}auto "
                            "(plain templates when there is none) or false, or use a tokenizer with one "
                            "(e.g. `rlhflab make-tiny --chat-template chatml`)")
        return True
    if setting is False or setting == "false":
        return False
    raise UserError(f"{key}: expected true, false or auto, got {setting!r}")


def special_token_ids(tokenizer) -> set[int]:
    """Ids of every special token: EOS/BOS/PAD and the added ones marked special."""
    ids = set(getattr(tokenizer, "all_special_ids", []) or [])
    for i, tok in (getattr(tokenizer, "added_tokens_decoder", None) or {}).items():
        if getattr(tok, "special", False):
            ids.add(int(i))
    return ids


def end_of_turn_id(tokenizer) -> int | None:
    """The token the chat template puts right after an assistant message, or None.

    None when the tokenizer has no template, the template cannot render a plain
    user/assistant exchange, or nothing special follows the assistant's text.
    """
    if not has_chat_template(tokenizer):
        return None
    try:
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": "hi"}, {"role": "assistant", "content": _MARK}], tokenize=False)
    except Exception:  # a template that needs other roles or raises on this conversation
        return None
    if not isinstance(text, str) or _MARK not in text:
        return None
    tail = text[text.rindex(_MARK) + len(_MARK):]
    special = special_token_ids(tokenizer)
    for i in tokenizer(tail, add_special_tokens=False)["input_ids"]:
        if i in special:
            return int(i)
    return None


def response_end_id(tokenizer, use_chat_template: bool) -> int | None:
    """The token a complete response ends with: the end-of-turn token under a chat
    template (when the template has one), else the tokenizer's EOS."""
    eot = end_of_turn_id(tokenizer) if use_chat_template else None
    return eot if eot is not None else tokenizer.eos_token_id
