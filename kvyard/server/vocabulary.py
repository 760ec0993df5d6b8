"""A checkpoint's tokenizer (a PlainTokenizer, or one transformers loaded) as the replica API's `Vocabulary`."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from kvyard.api.errors import InputError


class HFVocabulary:
    cheap = False

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        tokens: list[int] = self.tokenizer.encode(text, add_special_tokens=add_special_tokens)
        return tokens

    @property
    def chat_template(self) -> str | None:
        template = getattr(self.tokenizer, "chat_template", None)
        return template if isinstance(template, str) else None

    def render_chat(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool,
        template_kwargs: dict[str, Any] | None,
        tools: list[dict[str, Any]] | None = None,
    ) -> list[int]:
        if not getattr(self.tokenizer, "chat_template", None):
            raise InputError("this model has no chat template; use /v1/completions", "messages")
        try:
            text: str = self.tokenizer.apply_chat_template(
                messages,
                tools=tools,
                tokenize=False,
                add_generation_prompt=add_generation_prompt,
                **(template_kwargs or {}),
            )
        except Exception as error:
            raise InputError(f"chat template failed on these messages: {error}", "messages") from error
        return self.encode(text, add_special_tokens=False)

    def decode(self, token_ids: Sequence[int]) -> str:
        text: str = self.tokenizer.decode(list(token_ids))
        return text
