"""PlainTokenizer (tokenizer.json + chat template, no transformers) gives Hugging Face's results: encode, decode,
vocabulary, special tokens and chat templates, compared on the test models' tokenizers and on templates that use
the features real checkpoints use; directories it cannot read exactly go to transformers."""

from __future__ import annotations

import json
import random
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import jinja2
import pytest
from transformers import PreTrainedTokenizerFast

from kvyard.engine.model_setup import load_tokenizer as _load_tokenizer
from kvyard.models.tokenizer import GIL_FREE_ENCODE_CHARS, PlainTokenizer

DEMO_DIR = Path(__file__).resolve().parents[1] / "kvyard" / "testing" / "kvyard-demo"

TEXTS = (
    "",
    " ",
    "hello world",
    "  two leading spaces",
    "trailing space ",
    "tabs\tand\nnew\r\nlines\n\n\n",
    "naïve café – 東京 🚀",
    "e\u0301 composed by NFC where the tokenizer normalizes",
    "ﬁ ligature and ½",
    "<|eot_id|> inside text <|im_end|><|im_start|>user",
    "<|begin_of_text|>",
    "def f(x):\n    return x ** 2  # sq\n",
    "I'm sure they'll've done it; it's 3.14159 or 2,718.",
    "a" * 300,
    "\u200b zero width \ufeff bom",
)

CONVERSATIONS: tuple[list[dict[str, Any]], ...] = (
    [{"role": "user", "content": "Hi there!"}],
    [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "4", "tool_calls": None},
        {"role": "user", "content": "and 3+3?"},
    ],
    [{"role": "user", "content": [{"type": "text", "text": "part one, "}, {"type": "text", "text": "part two"}]}],
    [{"role": "user", "content": "Unicode: 東京 🚀 <|eot_id|>"}, {"role": "assistant", "content": "Sure: "}],
)

FEATURE_TEMPLATES = {
    "namespace_loopcontrols_tojson": (
        "{% set ns = namespace(count=0, last=none) %}\n"
        "{% for message in messages %}\n"
        "    {% if message.role == 'system' %}{% continue %}{% endif %}\n"
        "    {% set ns.count = ns.count + 1 %}\n"
        "    {{- message.role ~ ': ' ~ (message.content | tojson(indent=2)) }}\n"
        "    {% if ns.count >= 3 %}{% break %}{% endif %}\n"
        "{% endfor %}\n"
        "count={{ ns.count }}\n"
        "{% if add_generation_prompt %}{% generation %}assistant:{% endgeneration %}{% endif %}"
    ),
    "tools_documents_kwargs": (
        "{{ bos_token }}{% if tools %}TOOLS {{ tools | tojson }}\n{% endif %}"
        "{% if documents %}{% for d in documents %}[{{ d.title }}] {{ d.text }}\n{% endfor %}{% endif %}"
        "{% for m in messages %}<{{ m.role }}>"
        "{% if m.reasoning_content is defined %}(think: {{ m.reasoning_content }}/{{ m.thinking }}){% endif %}"
        "{{ m.content }}{{ eos_token }}{% endfor %}"
        "{% if enable_thinking is defined and not enable_thinking %}<no-think>{% endif %}"
        "{% if add_generation_prompt %}<assistant>{% endif %}"
    ),
    "dict_and_dates": (
        "{% set d = dict(a=1, b=[1, 2]) %}{{ d | tojson(sort_keys=True, separators=(',', ':')) }} "
        "{{ strftime_now('%Y') }} {{ messages | map(attribute='role') | join(',') }} "
        "{{ messages | selectattr('role', 'equalto', 'user') | list | length }}"
    ),
    "trims_and_strips": (
        "{% for m in messages %}\n"
        "   {% if m.role == 'user' %}\n"
        "USER {{ m.content }}\n"
        "   {% else %}\n"
        "OTHER {{ m.content }}\n"
        "   {% endif %}\n"
        "{% endfor %}\n"
    ),
}


def copy_tokenizer_dir(source: Path, target: Path) -> Path:
    target.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json", "config.json"):
        if (source / name).is_file():
            shutil.copy(source / name, target / name)
    return target


def edit_config(model_dir: Path, **changes: Any) -> None:
    path = model_dir / "tokenizer_config.json"
    config = json.loads(path.read_text())
    config.update(changes)
    path.write_text(json.dumps(config))


@pytest.fixture(scope="module", params=["llama", "qwen2", "qwen3", "demo"])
def tokenizer_dir(request: pytest.FixtureRequest, model_dirs: dict[str, Path]) -> Path:
    return DEMO_DIR if request.param == "demo" else model_dirs[request.param]


@pytest.fixture(scope="module")
def pair(tokenizer_dir: Path) -> tuple[PlainTokenizer, Any]:
    loaded = PlainTokenizer.load(tokenizer_dir)
    assert loaded.tokenizer is not None, loaded.reason
    return loaded.tokenizer, PreTrainedTokenizerFast.from_pretrained(tokenizer_dir)


def test_encode_matches_transformers(pair: tuple[PlainTokenizer, Any]) -> None:
    plain, hf = pair
    for text in TEXTS:
        for add_special_tokens in (True, False):
            expected = hf.encode(text, add_special_tokens=add_special_tokens)
            assert plain.encode(text, add_special_tokens) == expected, text


def test_a_long_text_encodes_as_transformers_does(pair: tuple[PlainTokenizer, Any]) -> None:
    """Past GIL_FREE_ENCODE_CHARS the other encode path (which lets other threads run) gives the same ids."""
    plain, hf = pair
    rng = random.Random(7)
    text = "".join(rng.choice(TEXTS[2:]) + " " for _ in range(GIL_FREE_ENCODE_CHARS // 20))
    assert len(text) > GIL_FREE_ENCODE_CHARS
    for add_special_tokens in (True, False):
        assert plain.encode(text, add_special_tokens) == hf.encode(text, add_special_tokens=add_special_tokens)


def test_decode_matches_transformers(pair: tuple[PlainTokenizer, Any]) -> None:
    plain, hf = pair
    rng = random.Random(0)
    special_ids = [hf.convert_tokens_to_ids(token) for token in hf.all_special_tokens]
    sequences = [hf.encode(text) for text in TEXTS]
    sequences += [[rng.randrange(len(hf)) for _ in range(rng.randrange(1, 40))] + special_ids for _ in range(50)]
    for ids in sequences:
        for skip in (False, True):
            assert plain.decode(ids, skip_special_tokens=skip) == hf.decode(ids, skip_special_tokens=skip), ids
    assert plain.decode(special_ids[0]) == hf.decode(special_ids[0])


def test_vocabulary_and_special_tokens_match(pair: tuple[PlainTokenizer, Any]) -> None:
    plain, hf = pair
    assert plain.get_vocab() == hf.get_vocab()
    assert len(plain) == len(hf)
    assert plain.special_tokens_map == hf.special_tokens_map
    assert (plain.bos_token_id, plain.eos_token_id, plain.pad_token_id) == (
        hf.bos_token_id,
        hf.eos_token_id,
        hf.pad_token_id,
    )
    tokens = [*hf.all_special_tokens, "not-a-token-anywhere", "a"]
    assert plain.convert_tokens_to_ids(tokens) == hf.convert_tokens_to_ids(tokens)


@pytest.mark.parametrize("conversation", CONVERSATIONS)
def test_model_chat_template_matches(pair: tuple[PlainTokenizer, Any], conversation: list[dict[str, Any]]) -> None:
    plain, hf = pair
    for add_generation_prompt in (False, True):
        expected = hf.apply_chat_template(conversation, tokenize=False, add_generation_prompt=add_generation_prompt)
        assert (
            plain.apply_chat_template(conversation, tokenize=False, add_generation_prompt=add_generation_prompt)
            == expected
        )
        ids = plain.apply_chat_template(conversation, add_generation_prompt=add_generation_prompt)
        assert ids == hf.encode(expected, add_special_tokens=False)
    if conversation[-1]["role"] == "assistant":
        expected = hf.apply_chat_template(conversation, tokenize=False, continue_final_message=True)
        assert plain.apply_chat_template(conversation, tokenize=False, continue_final_message=True) == expected


@pytest.mark.parametrize("name", sorted(FEATURE_TEMPLATES))
def test_template_features_match(llama_dir: Path, name: str) -> None:
    plain = PlainTokenizer.load(llama_dir).tokenizer
    assert plain is not None
    hf = PreTrainedTokenizerFast.from_pretrained(llama_dir)
    template = FEATURE_TEMPLATES[name]
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    documents = [{"title": "Doc", "text": "Some text <b>with tags</b>"}]
    reasoned = [{"role": "user", "content": "why?"}, {"role": "assistant", "content": "so", "reasoning": "I thought"}]
    conversations = [*CONVERSATIONS, reasoned]
    for conversation in conversations:
        for kwargs in (
            {},
            {"add_generation_prompt": True, "tools": tools, "documents": documents},
            {"enable_thinking": False},
        ):
            expected = hf.apply_chat_template(conversation, chat_template=template, tokenize=False, **kwargs)
            assert plain.apply_chat_template(conversation, chat_template=template, tokenize=False, **kwargs) == expected


def test_template_errors_match(llama_dir: Path) -> None:
    plain = PlainTokenizer.load(llama_dir).tokenizer
    assert plain is not None
    hf = PreTrainedTokenizerFast.from_pretrained(llama_dir)
    raising = (
        "{% for m in messages %}{% if m.role not in ['user'] %}{{ raise_exception('only users: ' ~ m.role) }}"
        "{% endif %}{% endfor %}"
    )
    conversation = [{"role": "robot", "content": "beep"}]
    with pytest.raises(jinja2.TemplateError, match="only users: robot") as ours:
        plain.apply_chat_template(conversation, chat_template=raising, tokenize=False)
    with pytest.raises(jinja2.TemplateError) as theirs:
        hf.apply_chat_template(conversation, chat_template=raising, tokenize=False)
    assert str(ours.value) == str(theirs.value)
    with pytest.raises(ValueError, match="empty conversation"):
        plain.apply_chat_template([], tokenize=False)


@pytest.mark.parametrize(
    "template",
    [
        "{{ messages[0].__class__.__mro__[1].__subclasses__() }}",
        "{{ ''.__class__.__base__.__subclasses__() }}",
        "{% set x = messages.append({'role': 'user'}) %}{{ x }}",
        "{% set ns = namespace(_hidden=1) %}{{ ns }}",
        "{% set ns = namespace(a=1) %}{% set ns.__dict__ = 2 %}{{ ns.a }}",
        "{{ cycler.__init__.__globals__ }}",
    ],
)
def test_sandbox_refuses_escapes(llama_dir: Path, template: str) -> None:
    plain = PlainTokenizer.load(llama_dir).tokenizer
    assert plain is not None
    with pytest.raises(jinja2.exceptions.SecurityError):
        plain.apply_chat_template([{"role": "user", "content": "x"}], chat_template=template, tokenize=False)


def test_named_templates_and_template_file(llama_dir: Path, tmp_path: Path) -> None:
    named = copy_tokenizer_dir(llama_dir, tmp_path / "named")
    edit_config(
        named,
        chat_template=[
            {"name": "default", "template": "D{{ messages[0].content }}"},
            {"name": "tool_use", "template": "T{{ (tools or []) | length }}"},
        ],
    )
    plain, hf = PlainTokenizer.load(named).tokenizer, PreTrainedTokenizerFast.from_pretrained(named)
    assert plain is not None
    conversation = [{"role": "user", "content": "hi"}]
    for kwargs in ({}, {"tools": [{"name": "f"}]}, {"chat_template": "tool_use"}):
        assert plain.apply_chat_template(conversation, tokenize=False, **kwargs) == hf.apply_chat_template(
            conversation, tokenize=False, **kwargs
        )
    file_first = copy_tokenizer_dir(llama_dir, tmp_path / "file")
    (file_first / "chat_template.jinja").write_text("from the file: {{ messages[0].content }}")
    plain, hf = PlainTokenizer.load(file_first).tokenizer, PreTrainedTokenizerFast.from_pretrained(file_first)
    assert plain is not None
    rendered = plain.apply_chat_template(conversation, tokenize=False)
    assert rendered == hf.apply_chat_template(conversation, tokenize=False) == "from the file: hi"


def test_directories_transformers_must_read(llama_dir: Path, tmp_path: Path) -> None:
    own_class = copy_tokenizer_dir(llama_dir, tmp_path / "own_class")
    edit_config(own_class, tokenizer_class="LlamaTokenizer")
    assert "has its own code" in PlainTokenizer.load(own_class).reason
    extra_token = copy_tokenizer_dir(llama_dir, tmp_path / "extra_token")
    config = json.loads((extra_token / "tokenizer_config.json").read_text())
    config["added_tokens_decoder"]["9999"] = {
        "content": "<|new|>",
        "lstrip": False,
        "normalized": False,
        "rstrip": False,
        "single_word": False,
        "special": True,
    }
    (extra_token / "tokenizer_config.json").write_text(json.dumps(config))
    assert "differs from tokenizer.json" in PlainTokenizer.load(extra_token).reason
    missing_special = copy_tokenizer_dir(llama_dir, tmp_path / "missing_special")
    edit_config(missing_special, unk_token="<unk>")
    assert "'<unk>'" in PlainTokenizer.load(missing_special).reason
    legacy = copy_tokenizer_dir(llama_dir, tmp_path / "legacy")
    (legacy / "added_tokens.json").write_text("{}")
    assert "added_tokens.json" in PlainTokenizer.load(legacy).reason
    # The engine loads those through transformers, and with transformers' result.
    fallback = _load_tokenizer(str(missing_special))
    assert not isinstance(fallback, PlainTokenizer)
    assert fallback.encode("hello") == PreTrainedTokenizerFast.from_pretrained(missing_special).encode("hello")
    assert isinstance(_load_tokenizer(str(llama_dir)), PlainTokenizer)


def test_serving_path_does_not_import_transformers(llama_dir: Path) -> None:
    script = (
        "import sys\nfrom kvyard.engine.llm import LLM\nllm = LLM(sys.argv[1])\n"
        "loaded = sorted(m for m in sys.modules if m.split('.')[0] == 'transformers')\n"
        "print(type(llm.tokenizer).__name__, loaded)"
    )
    result = subprocess.run([sys.executable, "-c", script, str(llama_dir)], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["PlainTokenizer", "[]"], result.stdout
