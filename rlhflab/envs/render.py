"""Rendering an episode with the chat template, one turn's delta at a time.

The model's own tokens are never re-tokenised. An episode's token sequence grows as

    prompt   = tokens of render(opening messages, add_generation_prompt=True)
    + the ids the model generated (its end-of-turn token included)       actions
    + tokens of the delta for the environment's/tools' answer            context
    + the ids the model generated next ...

The delta of new messages N after a conversation M whose last message is the model's turn:

    A = render(M)                                   (no generation prompt)
    B = render(M + N, add_generation_prompt=True)
    delta = (what A has after the assistant's end-of-turn token) + B[len(A):]

The first part is the template's text between the end-of-turn token and the next message
(ChatML's "\\n" after ``<|im_end|>``; nothing in Llama 3), which the model does not
generate. This needs the template's *prefix property*: render(M + N) starts with
render(M). ChatML (SmolLM2, Qwen2.5) and Llama 3 templates have it; a template that
rewrites earlier turns when a later one is added (Qwen3's, which drops the reasoning of
assistant turns before the last user message) breaks it, and `delta` says so.

Tokens of a delta are tokenised alone (``add_special_tokens=False``), so the ids at a
boundary may differ from a whole-text tokenisation; the ids appended are the ones the
model then sees and is trained on, so sampling and training agree by construction.
"""

from __future__ import annotations

from typing import Sequence

from rlhflab.envs.base import EnvError


class ChatRenderer:
    """Renders messages with a tokenizer's chat template (and the tools' schemas)."""

    def __init__(self, tokenizer, tool_schemas: Sequence[dict] | None = None):
        from rlhflab.data.chat import end_of_turn_id, has_chat_template

        self.tokenizer = tokenizer
        self.tools = list(tool_schemas) if tool_schemas else None
        name = getattr(tokenizer, "name_or_path", "") or "the tokenizer"
        self.name = name
        if not has_chat_template(tokenizer):
            raise EnvError(f"multi-turn episodes need a chat template, and {name!r} has none; use a chat model "
                           "(or a tiny model made with `rlhflab make-tiny --chat-template chatml`)")
        self.end_of_turn_id = end_of_turn_id(tokenizer)
        if self.end_of_turn_id is None:
            raise EnvError(f"the chat template of {name!r} puts no special end-of-turn token after an assistant "
                           "message, so turns cannot be told apart; use a template that closes each turn "
                           "(ChatML's <|im_end|>, Llama 3's <|eot_id|>)")
        self.end_of_turn = tokenizer.convert_ids_to_tokens(self.end_of_turn_id)

    def render(self, messages: Sequence[dict], add_generation_prompt: bool) -> str:
        try:
            return self.tokenizer.apply_chat_template(list(messages), tools=self.tools, tokenize=False,
                                                      add_generation_prompt=add_generation_prompt)
        except Exception as exc:
            roles = ",".join(m.get("role", "?") for m in messages)
            raise EnvError(f"the chat template of {self.name!r} cannot render a conversation with roles [{roles}] "
                           f"({type(exc).__name__}: {str(exc).strip()[:80]}); have the environment use roles this "
                           "template knows (many accept only user/assistant, or need the system message first)") \
                from None

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def prompt(self, messages: Sequence[dict]) -> tuple[str, list[int]]:
        """The opening of an episode: its text and ids, ending with the generation prompt."""
        text = self.render(messages, add_generation_prompt=True)
        return text, self.encode(text)

    def delta(self, messages: Sequence[dict], new: Sequence[dict]) -> tuple[str, list[int]]:
        """The text and ids that follow the model's end-of-turn token when `new` messages
        answer the conversation `messages` (whose last message is the model's turn)."""
        before = self.render(messages, add_generation_prompt=False)
        after = self.render(list(messages) + list(new), add_generation_prompt=True)
        if not after.startswith(before):
            at = next((i for i, (a, b) in enumerate(zip(before, after)) if a != b), min(len(before), len(after)))
            raise EnvError(f"the chat template of {self.name!r} re-renders earlier turns when a message is added "
                           f"(the two renderings part at character {at}: {before[at:at + 30]!r} vs "
                           f"{after[at:at + 30]!r}), so the model's tokens cannot be kept as generated; use a "
                           "template whose rendering of a conversation starts with that of each of its prefixes")
        cut = before.rfind(self.end_of_turn)
        if cut < 0:
            raise EnvError(f"the chat template of {self.name!r} does not close the assistant's turn with "
                           f"{self.end_of_turn!r}; multi-turn episodes need it")
        text = before[cut + len(self.end_of_turn):] + after[len(before):]
        return text, self.encode(text)
