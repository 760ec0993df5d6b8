"""Reasoning models' thinking, taken out of the answer (`--reasoning-parser`): `message.reasoning_content` and the
streamed `delta.reasoning_content`, as vLLM's OpenAI server sends them.

- `qwen3` (Qwen3, QwQ): an answer that starts with `<think>` reasons until `</think>`; one that does not (thinking
  turned off by `chat_template_kwargs: {"enable_thinking": false}`) is all content.
- `deepseek_r1` (DeepSeek-R1 and its distillations): the chat template opens `<think>` in the prompt, so the
  answer reasons from its first token until `</think>`.

An answer cut off before `</think>` (`max_tokens`) is reasoning to its end and has no content, in a stream and
in a whole answer alike. While streaming, characters that may begin `</think>` are held back until they are
known not to.
"""

from __future__ import annotations

from dataclasses import dataclass

START, END = "<think>", "</think>"
REASONING_PARSERS = ("qwen3", "deepseek_r1")


@dataclass(frozen=True, slots=True)
class Split:
    reasoning: str
    content: str
    settled: int  # characters of the text whose side is known (the rest may still turn out to be part of a tag)


@dataclass(frozen=True, slots=True)
class ReasoningParser:
    name: str
    opens_in_prompt: bool  # the template opened <think>: the answer starts inside the reasoning

    @classmethod
    def named(cls, name: str | None) -> ReasoningParser | None:
        if name is None:
            return None
        if name not in REASONING_PARSERS:
            raise ValueError(f"unknown reasoning parser {name!r}; choose one of {', '.join(REASONING_PARSERS)}")
        return cls(name, opens_in_prompt=name == "deepseek_r1")

    def split(self, text: str, finished: bool) -> Split:
        """`text`, the answer so far, as reasoning and content (`finished`: nothing more will come)."""
        if not finished and len(text.lstrip()) < len(START) and START.startswith(text.lstrip()):
            return Split("", "", 0)  # it may yet open with <think>
        start = self._reasoning_start(text)
        if start is None:  # thinking is off: all content
            return Split("", text, len(text))
        end = text.find(END, start)
        if end >= 0:
            return Split(text[start:end], text[end + len(END) :], len(text))
        settled = len(text) if finished else len(text) - _partial_tag(text, END)
        return Split(text[start:settled], "", settled)

    def _reasoning_start(self, text: str) -> int | None:
        """Where the reasoning starts in `text`, None when the answer is content (or may not be reasoning yet)."""
        stripped = text.lstrip()
        if stripped.startswith(START):
            return len(text) - len(stripped) + len(START)
        return 0 if self.opens_in_prompt else None


def _partial_tag(text: str, tag: str) -> int:
    """The length of the longest end of `text` that begins `tag` (what cannot be sent yet)."""
    for length in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:length]):
            return length
    return 0


@dataclass(slots=True)
class ReasoningStream:
    """How much reasoning a streamed answer has sent; `delta` gives what is new."""

    parser: ReasoningParser
    sent_reasoning: int = 0

    def delta(self, text: str, finished: bool) -> tuple[str, Split]:
        """The reasoning `text` (the answer so far) adds, and its whole split; content is the caller's to send (as
        text, or as tool calls)."""
        split = self.parser.split(text, finished)
        reasoning = split.reasoning[self.sent_reasoning :]
        self.sent_reasoning = len(split.reasoning)
        return reasoning, split
