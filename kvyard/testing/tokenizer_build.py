"""Train a small byte-level BPE tokenizer locally and write it in Hugging Face format.

The training text is a fixed, sorted list of CPython standard-library sources (plus the English
prose in ``pydoc_data/topics.py``), so it exists wherever this Python does and training needs no
download. For a given Python version the result is byte-identical from run to run; a different
CPython release ships different sources and so trains a slightly different tokenizer.
"""

from __future__ import annotations

import json
import sysconfig
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers

# Qwen2's pre-tokenizer split pattern; llama.cpp's GGUF converter is told pre-tokenizer "qwen2".
QWEN2_SPLIT_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

# Long-standing standard-library modules (about 3.6 MB in CPython 3.11); missing ones are skipped.
CORPUS_FILES = (
    "_pydecimal.py",
    "argparse.py",
    "ast.py",
    "calendar.py",
    "collections/__init__.py",
    "configparser.py",
    "csv.py",
    "dataclasses.py",
    "difflib.py",
    "doctest.py",
    "email/message.py",
    "enum.py",
    "fractions.py",
    "functools.py",
    "gettext.py",
    "html/entities.py",
    "http/client.py",
    "http/server.py",
    "inspect.py",
    "ipaddress.py",
    "json/decoder.py",
    "json/encoder.py",
    "locale.py",
    "logging/__init__.py",
    "mailbox.py",
    "os.py",
    "pickle.py",
    "pydoc.py",
    "pydoc_data/topics.py",
    "random.py",
    "shutil.py",
    "smtplib.py",
    "statistics.py",
    "string.py",
    "subprocess.py",
    "tarfile.py",
    "textwrap.py",
    "threading.py",
    "tokenize.py",
    "traceback.py",
    "typing.py",
    "unittest/case.py",
    "urllib/parse.py",
    "urllib/request.py",
    "xml/dom/minidom.py",
    "xml/etree/ElementTree.py",
)

# Chat templates written for kvyard. Message content may be a string or a list of
# {"type": "text", "text": ...} parts (OpenAI style); other part types are ignored.
_CONTENT_MACRO = (
    "{%- macro text(content) -%}"
    "{%- if content is string -%}{{ content }}"
    "{%- else -%}{%- for part in content if part['type'] == 'text' -%}{{ part['text'] }}{%- endfor -%}"
    "{%- endif -%}"
    "{%- endmacro -%}"
)
# Tool calling: with `tools`, a system turn lists the functions as JSON and says how to call them; an
# assistant turn's `tool_calls` and a `tool` turn's result are written the way the model is told to call.
# Without tools the templates render exactly as they did before tools existed.
_ARGUMENTS_MACRO = (
    "{%- macro arguments(call) -%}"
    "{%- if call['arguments'] is string -%}{{ call['arguments'] }}{%- else -%}{{ call['arguments'] | tojson }}"
    "{%- endif -%}"
    "{%- endmacro -%}"
)
CHATML_TEMPLATE = (
    _CONTENT_MACRO
    + _ARGUMENTS_MACRO
    + (
        "{%- set skip_first = tools and messages and messages[0]['role'] == 'system' -%}"
        "{%- if tools -%}"
        "{{ '<|im_start|>system\n' }}"
        "{%- if skip_first -%}{{ text(messages[0]['content']) + '\n\n' }}{%- endif -%}"
        "{{ 'Functions you can call, one JSON signature per line:\n<tools>\n' }}"
        "{%- for tool in tools -%}{{ (tool['function'] if tool['function'] is defined else tool) | tojson + '\n' }}"
        "{%- endfor -%}"
        "{{ '</tools>\nTo call one, answer with <tool_call></tool_call> tags around a JSON object holding its '"
        ' + \'name and arguments:\n<tool_call>\n{"name": "the function", "arguments": {}}\n\''
        " + '</tool_call><|im_end|>\n' }}"
        "{%- endif -%}"
        "{%- for message in messages -%}"
        "{%- if loop.first and skip_first -%}"
        "{%- elif message['role'] == 'tool' -%}"
        "{{ '<|im_start|>user\n<tool_response>\n' + text(message['content']) + '\n</tool_response><|im_end|>\n' }}"
        "{%- elif message['role'] == 'assistant' and message['tool_calls'] -%}"
        "{{ '<|im_start|>assistant\n' + text(message['content'] or '') }}"
        "{%- for tool_call in message['tool_calls'] -%}"
        "{%- set call = tool_call['function'] if tool_call['function'] is defined else tool_call -%}"
        "{{ '<tool_call>\n{\"name\": ' + call['name'] | tojson + ', \"arguments\": ' + arguments(call)"
        " + '}\n</tool_call>' }}"
        "{%- endfor -%}"
        "{{ '<|im_end|>\n' }}"
        "{%- else -%}"
        "{{ '<|im_start|>' + message['role'] + '\n' + text(message['content']) + '<|im_end|>\n' }}"
        "{%- endif -%}"
        "{%- endfor -%}"
        "{%- if add_generation_prompt -%}{{ '<|im_start|>assistant\n' }}{%- endif -%}"
    )
)
LLAMA3_TEMPLATE = (
    _CONTENT_MACRO
    + _ARGUMENTS_MACRO
    + (
        "{{ bos_token }}"
        "{%- if tools -%}"
        "{{ '<|start_header_id|>system<|end_header_id|>\n\n' + 'Functions you can call, one JSON signature per '"
        " + 'line:\n' }}"
        "{%- for tool in tools -%}{{ (tool['function'] if tool['function'] is defined else tool) | tojson + '\n' }}"
        "{%- endfor -%}"
        '{{ \'To call one, answer with only a JSON object: {"name": the function, "parameters": its \''
        " + 'arguments}.<|eot_id|>' }}"
        "{%- endif -%}"
        "{%- for message in messages -%}"
        "{%- if message['role'] == 'tool' -%}"
        "{{ '<|start_header_id|>ipython<|end_header_id|>\n\n' + text(message['content']) + '<|eot_id|>' }}"
        "{%- elif message['role'] == 'assistant' and message['tool_calls'] -%}"
        "{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}"
        "{%- for tool_call in message['tool_calls'] -%}"
        "{%- set call = tool_call['function'] if tool_call['function'] is defined else tool_call -%}"
        "{%- if not loop.first -%}{{ '; ' }}{%- endif -%}"
        "{{ '{\"name\": ' + call['name'] | tojson + ', \"parameters\": ' + arguments(call) + '}' }}"
        "{%- endfor -%}"
        "{{ '<|eot_id|>' }}"
        "{%- else -%}"
        "{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'"
        " + text(message['content']) + '<|eot_id|>' }}"
        "{%- endif -%}"
        "{%- endfor -%}"
        "{%- if add_generation_prompt -%}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{%- endif -%}"
    )
)


@dataclass(frozen=True, slots=True)
class ChatFormat:
    """Special tokens and chat template of one tokenizer family."""

    special_tokens: tuple[str, ...]
    bos_token: str | None  # prepended on encode when set (Llama 3 style)
    eos_token: str  # end of turn: where chat generation stops
    text_end_token: str  # end of a document; also the pad token
    chat_template: str
    nfc: bool  # NFC-normalize input (as Qwen2/Qwen3 do; transformers forces it for model_type qwen2)


CHATML = ChatFormat(
    special_tokens=("<|endoftext|>", "<|im_start|>", "<|im_end|>"),
    bos_token=None,
    eos_token="<|im_end|>",
    text_end_token="<|endoftext|>",
    chat_template=CHATML_TEMPLATE,
    nfc=True,
)
LLAMA3 = ChatFormat(
    special_tokens=(
        "<|begin_of_text|>",
        "<|end_of_text|>",
        "<|start_header_id|>",
        "<|end_header_id|>",
        "<|eot_id|>",
    ),
    bos_token="<|begin_of_text|>",
    eos_token="<|eot_id|>",
    text_end_token="<|end_of_text|>",
    chat_template=LLAMA3_TEMPLATE,
    nfc=False,
)


def corpus_texts(max_chars: int | None = None, stdlib_dir: Path | None = None) -> list[str]:
    """The training texts in a fixed order, whole files until `max_chars` is reached.

    Files missing from this Python are skipped.
    """
    root = Path(stdlib_dir or sysconfig.get_paths()["stdlib"])
    texts: list[str] = []
    total = 0
    for path in (root / name for name in sorted(CORPUS_FILES)):
        if max_chars is not None and total >= max_chars:
            break
        if path.is_file():
            texts.append(path.read_text(encoding="utf-8"))
            total += len(texts[-1])
    if not texts:
        raise FileNotFoundError(f"no tokenizer training sources found under {root}")
    return texts


def train_tokenizer(vocab_size: int, chat: ChatFormat, texts: Sequence[str] | None = None) -> Tokenizer:
    """Byte-level BPE with `vocab_size` entries in total; special tokens take the last ids.

    Without `texts`, trains on about 1000 characters of corpus per vocabulary entry (a small
    vocabulary needs little text, and counting words dominates training time). If the corpus runs
    out of merges first, the vocabulary is smaller than asked.
    """
    tokenizer = Tokenizer(models.BPE())
    if chat.nfc:
        tokenizer.normalizer = normalizers.NFC()
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN2_SPLIT_REGEX), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size - len(chat.special_tokens),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(corpus_texts(1000 * vocab_size) if texts is None else texts, trainer=trainer)
    tokenizer.add_special_tokens(list(chat.special_tokens))
    if chat.bos_token is not None:
        bos = (chat.bos_token, special_token_id(tokenizer, chat.bos_token))
        tokenizer.post_processor = processors.TemplateProcessing(
            single=f"{chat.bos_token} $A",
            pair=f"{chat.bos_token} $A {chat.bos_token} $B:1",
            special_tokens=[bos],
        )
    else:
        tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    return tokenizer


def special_token_id(tokenizer: Tokenizer, token: str) -> int:
    token_id = tokenizer.token_to_id(token)
    if token_id is None:
        raise KeyError(f"{token!r} is not in the tokenizer's vocabulary")
    return token_id


def write_tokenizer(tokenizer: Tokenizer, chat: ChatFormat, out_dir: Path, model_max_length: int) -> None:
    """Write tokenizer.json, tokenizer_config.json and special_tokens_map.json to `out_dir`."""
    tokenizer.save(str(out_dir / "tokenizer.json"), pretty=True)
    special = {
        "bos_token": chat.bos_token,
        "eos_token": chat.eos_token,
        "pad_token": chat.text_end_token,
    }
    added = {
        str(special_token_id(tokenizer, token)): {
            "content": token,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": True,
        }
        for token in chat.special_tokens
    }
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        **special,
        "added_tokens_decoder": added,
        "chat_template": chat.chat_template,
        "clean_up_tokenization_spaces": False,
        "model_input_names": ["input_ids", "attention_mask"],
        "model_max_length": model_max_length,
    }
    _write_json(out_dir / "tokenizer_config.json", config)
    _write_json(out_dir / "special_tokens_map.json", {k: v for k, v in special.items() if v is not None})


def _write_json(path: Path, obj: Any) -> None:
    path.write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
