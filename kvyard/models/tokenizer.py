"""A checkpoint's tokenizer read with the `tokenizers` library alone, without importing `transformers`.

Importing transformers costs about half a second of a server's start-up, and for most checkpoints it adds
nothing: their tokenizer_config.json names the generic fast tokenizer, and tokenizer.json already holds the whole
pipeline (normalizer, pre-tokenizer, model, post-processor, decoder, added tokens). `PlainTokenizer.load` takes
those directories, and only those whose files say exactly what transformers would build from them; for any
other it returns None with the reason, and the caller loads the tokenizer through transformers.

`PlainTokenizer` has the part of the Hugging Face tokenizer API that kvyard uses (encode, decode, the vocabulary,
special tokens, `apply_chat_template`), with the same results (tests/test_plain_tokenizer.py compares them).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jinja2
from tokenizers import Tokenizer

from kvyard.models.chat_template import compile_chat_template, render_chat_template

GENERIC_TOKENIZER_CLASSES = ("PreTrainedTokenizerFast", "TokenizersBackend")
NAMED_SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
ADDED_TOKEN_FIELDS = ("content", "single_word", "lstrip", "rstrip", "normalized", "special")
GIL_FREE_ENCODE_CHARS = 64 << 10  # longer texts are encoded without holding the interpreter lock (see encode)
# transformers patches the pre-tokenizer regex of some Mistral-family checkpoints when it loads them.
PATCHED_MODEL_TYPES = ("mistral", "mistral3", "ministral", "ministral3", "voxtral", "pixtral")
# Files transformers reads beside tokenizer.json that change what it builds; where one is present it loads.
LEGACY_FILES = ("added_tokens.json", "chat_template.json", "additional_chat_templates")


@dataclass(slots=True)
class Loaded:
    tokenizer: PlainTokenizer | None
    reason: str  # why transformers must load it; "" when `tokenizer` is set


class PlainTokenizer:
    """tokenizer.json and the chat template of one checkpoint, with Hugging Face's tokenizer results."""

    def __init__(
        self, backend: Tokenizer, special_tokens: Mapping[str, str], chat_template: str | dict[str, str] | None
    ) -> None:
        self.backend_tokenizer = backend
        self.special_tokens_map = dict(special_tokens)
        self.chat_template = chat_template
        self._compiled: dict[str, jinja2.Template] = {}

    @classmethod
    def load(cls, model_dir: str | Path) -> Loaded:
        """The tokenizer of `model_dir`, or None and the reason transformers has to load it."""
        root = Path(model_dir)
        try:
            config = json.loads((root / "tokenizer_config.json").read_text(encoding="utf-8"))
            tokenizer_json = json.loads((root / "tokenizer.json").read_text(encoding="utf-8"))
            model_config = _read_optional_json(root / "config.json")
        except (OSError, ValueError) as error:
            return Loaded(None, f"tokenizer files unreadable here ({error})")
        reason = _why_not_plain(root, config, tokenizer_json, model_config)
        if reason:
            return Loaded(None, reason)
        backend = Tokenizer.from_file(str(root / "tokenizer.json"))
        special = {name: _token_content(config[name]) for name in NAMED_SPECIAL_TOKENS if config.get(name) is not None}
        return Loaded(cls(backend, special, _chat_template(root, config)), "")

    def __len__(self) -> int:
        return int(self.backend_tokenizer.get_vocab_size(with_added_tokens=True))

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        backend = self.backend_tokenizer
        if len(text) < GIL_FREE_ENCODE_CHARS:
            ids: list[int] = backend.encode(text, add_special_tokens=add_special_tokens).ids
            return ids
        # `tokenizers` holds the interpreter lock through encode() (2.4 s for 3.6 MB of text: every other thread,
        # the server's event loop included, stops) but releases it in encode_batch(), with the same ids.
        batch_ids: list[int] = backend.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids
        return batch_ids

    def decode(self, token_ids: int | Sequence[int], skip_special_tokens: bool = False) -> str:
        ids = [token_ids] if isinstance(token_ids, int) else list(token_ids)
        text: str = self.backend_tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)
        return text

    def get_vocab(self) -> dict[str, int]:
        vocab: dict[str, int] = self.backend_tokenizer.get_vocab(with_added_tokens=True)
        return vocab

    def convert_tokens_to_ids(self, tokens: str | Sequence[str]) -> int | list[int | None] | None:
        if isinstance(tokens, str):
            return self._token_id(tokens)
        return [self._token_id(token) for token in tokens]

    @property
    def bos_token_id(self) -> int | None:
        return self._special_id("bos_token")

    @property
    def eos_token_id(self) -> int | None:
        return self._special_id("eos_token")

    @property
    def pad_token_id(self) -> int | None:
        return self._special_id("pad_token")

    def apply_chat_template(
        self,
        conversation: Sequence[Mapping[str, Any]],
        tools: Sequence[Mapping[str, Any]] | None = None,
        documents: Sequence[Mapping[str, Any]] | None = None,
        chat_template: str | None = None,
        add_generation_prompt: bool = False,
        continue_final_message: bool | str = False,
        tokenize: bool = True,
        **kwargs: Any,
    ) -> str | list[int]:
        """The conversation rendered by the chat template (named, given, or the checkpoint's); its token ids when
        `tokenize` (a plain list, not transformers' BatchEncoding)."""
        source = self._template_source(chat_template, tools)
        template = self._compiled.get(source)
        if template is None:
            template = self._compiled.setdefault(source, compile_chat_template(source))
        text = render_chat_template(
            template,
            source,
            conversation,
            tools,
            documents,
            add_generation_prompt,
            continue_final_message,
            {**self.special_tokens_map, **kwargs},
        )
        return self.encode(text, add_special_tokens=False) if tokenize else text

    def _template_source(self, chat_template: str | None, tools: object) -> str:
        templates = self.chat_template
        if isinstance(templates, dict):
            if chat_template is not None:
                return templates.get(chat_template, chat_template)
            name = "tool_use" if tools is not None and "tool_use" in templates else "default"
            if name not in templates:
                raise ValueError(
                    f"this model has several chat templates and none is the default: name one of {sorted(templates)}"
                )
            return templates[name]
        if chat_template is not None:
            return chat_template
        if templates is None:
            raise ValueError("this model has no chat template")
        return templates

    def _special_id(self, name: str) -> int | None:
        token = self.special_tokens_map.get(name)
        return None if token is None else self._token_id(token)

    def _token_id(self, token: str) -> int | None:
        token_id: int | None = self.backend_tokenizer.token_to_id(token)
        unknown = self.special_tokens_map.get("unk_token")
        if token_id is None and unknown is not None:
            return self.backend_tokenizer.token_to_id(unknown)
        return token_id


def _why_not_plain(
    root: Path, config: dict[str, Any], tokenizer_json: dict[str, Any], model_config: dict[str, Any]
) -> str:
    if config.get("tokenizer_class") not in GENERIC_TOKENIZER_CLASSES:
        return f"tokenizer_class {config.get('tokenizer_class')!r} has its own code in transformers"
    if model_config.get("model_type") in PATCHED_MODEL_TYPES:
        return f"transformers patches {model_config['model_type']} tokenizers as it loads them"
    if present := [name for name in LEGACY_FILES if (root / name).exists()]:
        return f"{', '.join(present)} beside tokenizer.json"
    if "added_tokens_decoder" not in config:
        return "tokenizer_config.json without added_tokens_decoder (the legacy special_tokens_map.json path)"
    if config.get("split_special_tokens") or "add_prefix_space" in config:
        return "split_special_tokens or add_prefix_space set in tokenizer_config.json"
    if tokenizer_json.get("truncation") is not None or tokenizer_json.get("padding") is not None:
        return "truncation or padding set in tokenizer.json"
    if config.get("clean_up_tokenization_spaces") and tokenizer_json.get("model", {}).get("type") != "BPE":
        return "clean_up_tokenization_spaces on a tokenizer that is not BPE"
    return _added_tokens_mismatch(config, tokenizer_json)


def _added_tokens_mismatch(config: dict[str, Any], tokenizer_json: dict[str, Any]) -> str:
    """Transformers adds to the backend what tokenizer_config.json lists and tokenizer.json lacks; a directory
    where nothing would be added is read as it is."""
    in_json = {int(token["id"]): token for token in tokenizer_json.get("added_tokens") or []}
    contents = {token["content"] for token in in_json.values()}
    for token_id, token in config["added_tokens_decoder"].items():
        stored = in_json.get(int(token_id))
        if (
            not isinstance(token, dict)
            or stored is None
            or any(token.get(field) != stored.get(field) for field in ADDED_TOKEN_FIELDS)
        ):
            return f"added token {token_id} of tokenizer_config.json differs from tokenizer.json's"
    listed = [config.get(name) for name in NAMED_SPECIAL_TOKENS]
    for extra in ("extra_special_tokens", "additional_special_tokens"):
        value = config.get(extra)
        listed += list(value.values()) if isinstance(value, dict) else list(value or [])
    for token in listed:
        if token is not None and _token_content(token) not in contents:
            return f"special token {_token_content(token)!r} is not among tokenizer.json's added tokens"
    return ""


def _token_content(token: Any) -> str:
    return str(token["content"]) if isinstance(token, dict) else str(token)


def _chat_template(root: Path, config: dict[str, Any]) -> str | dict[str, str] | None:
    """chat_template.jinja first (transformers v5 writes it), then the entry in tokenizer_config.json, a string or
    a list of named templates."""
    path = root / "chat_template.jinja"
    if path.is_file():
        return path.read_text(encoding="utf-8")
    template = config.get("chat_template")
    if isinstance(template, list):
        return {entry["name"]: entry["template"] for entry in template}
    return template if isinstance(template, str) else None


def _read_optional_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    value = json.loads(path.read_text(encoding="utf-8"))
    return value if isinstance(value, dict) else {}
