"""Chat-template rendering for multi-turn rollouts, token-in/token-out.

A conversation is rendered to text once per piece and tokenized once per piece: the first prompt (with the tool
schemas, `tools=`), then each observation as the *continuation* the template writes after the model's reply (the
end of the assistant turn the engine did not generate, the tool / user messages, the next generation prompt).
The rollout appends these ids to the engine's own ids, so the sequence trained on is exactly what the engine
saw and produced: the history is never decoded and re-tokenised (which can merge tokens across a boundary).

The continuation is found by rendering a fixed two-message conversation with and without the new messages and
taking the difference; a template that rewrites earlier turns when a message is added cannot be continued this
way and is refused with one line.
"""

from __future__ import annotations

import gc
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from relayrl.environments.interfaces import Message

#: Stands in for the assistant's reply in the reference conversation the continuation is measured against.
_REPLY = "\u2063relayrl-reply\u2063"
_BASE: list[Message] = [
    {"role": "user", "content": "\u2063relayrl-user\u2063"},
    {"role": "assistant", "content": _REPLY},
]


class ChatTemplateError(ValueError):
    """The chat template cannot render a conversation the rollout needs (one line naming the problem)."""


@dataclass
class ChatRenderer:
    """Renders prompts and observation continuations with `tokenizer`'s chat template and tokenizes them."""

    tokenizer: Any
    _cache: dict[str, tuple[str, str]] = field(default_factory=dict)

    def prompt(
        self, messages: list[Message], tools: list[dict[str, Any]] | None, template_kwargs: dict[str, Any]
    ) -> tuple[str, list[int]]:
        """(text, ids) of the first prompt: `messages` rendered with the generation prompt."""
        text = self._render(messages, tools, template_kwargs, add_generation_prompt=True)
        return text, self._ids(text)

    def observation(
        self,
        reply_ids: list[int],
        messages: list[Message],
        tools: list[dict[str, Any]] | None,
        template_kwargs: dict[str, Any],
    ) -> tuple[str, list[int]]:
        """(text, ids) fed after the engine's reply `reply_ids`: the rest of the assistant turn's closing text (what
        the engine did not generate: all of it when it stopped without its end-of-turn token), `messages` as the
        template renders them, and the next generation prompt."""
        close, delta = self._continuation(messages, tools, template_kwargs)
        done = self._closed_by(reply_ids, close)
        text = close[done:] + delta
        return text, self._ids(text)

    # ------------------------------------------------------------------ internals
    def _render(
        self, messages: list[Message], tools: list[dict[str, Any]] | None, kwargs: dict[str, Any], **more: Any
    ) -> str:
        try:
            out = self.tokenizer.apply_chat_template(messages, tools=tools, tokenize=False, **kwargs, **more)
        except Exception as exc:  # jinja errors: the template's own message
            first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
            raise ChatTemplateError(f"the chat template failed to render a rollout conversation: {first}") from None
        return str(out)

    def _continuation(
        self, messages: list[Message], tools: list[dict[str, Any]] | None, kwargs: dict[str, Any]
    ) -> tuple[str, str]:
        """(closing text of an assistant turn, rendering of `messages` + generation prompt after it)."""
        key = repr((tools, sorted(kwargs.items()), messages))
        hit = self._cache.get(key)
        if hit is not None:
            return hit
        base = self._render(_BASE, tools, kwargs)
        at = base.rfind(_REPLY)
        if at < 0:
            raise ChatTemplateError("the chat template does not render an assistant message's content")
        close = base[at + len(_REPLY) :]
        full = self._render([*_BASE, *messages], tools, kwargs, add_generation_prompt=True)
        if not full.startswith(base):
            raise ChatTemplateError(
                f"the chat template renders the conversation differently once a {messages[0]['role']!r} message "
                "follows the reply, so observations cannot be appended token-in/token-out; use a template that only "
                "appends (policy.tokenizer.chat_template)"
            )
        out = (close, full[len(base) :])
        if len(self._cache) < 4096:
            self._cache[key] = out
        return out

    def _closed_by(self, reply_ids: list[int], close: str) -> int:
        """How many characters of `close` the reply already holds: the end-of-turn token the engine stopped on
        (a special token whose text begins `close`), else none."""
        if not reply_ids or not close:
            return 0
        last = int(reply_ids[-1])
        if last not in set(self.tokenizer.all_special_ids):
            return 0
        text = self.tokenizer.decode([last], skip_special_tokens=False)
        return len(text) if text and close.startswith(text) else 0

    def _ids(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])


@contextmanager
def no_gc_pauses() -> Iterator[None]:
    """Building tens of thousands of small objects (one per prompt) sets off the cyclic collector's full passes,
    each over every object torch and transformers hold; none of these objects can form a cycle worth collecting
    mid-build, so the collector waits until the build is done."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def _token_ids(tokenizer: Any, texts: list[str]) -> list[list[int]]:
    """`tokenizer(texts, add_special_tokens=False)["input_ids"]`. A fast tokenizer whose backend carries no
    truncation or padding is asked directly: the same ids, without transformers building one dict of optional
    fields per text (most of the time it takes)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None and backend.truncation is None and backend.padding is None:
        return [enc.ids for enc in backend.encode_batch(texts, add_special_tokens=False)]
    return list(tokenizer(texts, add_special_tokens=False)["input_ids"])


def render_prompts(
    tokenizer: Any,
    conversations: Sequence[list[dict[str, str]]],
    chat_template_kwargs: Mapping[str, Any] | None = None,
    chunk: int = 1024,
) -> Iterator[tuple[int, list[str], list[list[int]]]]:
    """Each chunk of conversations rendered as prompts (generation prompt opened) and tokenized in one call each:
    yields (index of the chunk's first conversation, texts, token ids)."""
    with no_gc_pauses():
        for start in range(0, len(conversations), chunk):
            texts = tokenizer.apply_chat_template(
                list(conversations[start : start + chunk]),
                tokenize=False,
                add_generation_prompt=True,
                **(chat_template_kwargs or {}),
            )
            yield start, texts, _token_ids(tokenizer, texts)
