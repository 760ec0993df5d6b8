"""Tests for kvyard.testing.create_model: random-weight HF models with a locally trained tokenizer."""

from __future__ import annotations

import json
import unicodedata
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors import safe_open
from tokenizers import Tokenizer
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerFast

from kvyard.testing import create_model as create
from kvyard.testing.create_model import ARCHITECTURES, create_model, default_model_dir, ensure_default_model

MODEL_CLASSES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}
END_OF_TURN = {"llama": "<|eot_id|>", "qwen2": "<|im_end|>", "qwen3": "<|im_end|>"}
MODEL_FILES = (
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "special_tokens_map.json",
    "tokenizer.json",
    "tokenizer_config.json",
)
TEXTS = (
    "Hello, world! It's a test.",
    "def f(x):\r\n\treturn x ** 2  # squared\n\n\n",
    "Grüße aus Köln — ünïcødé, 日本語のテキスト, 한국어, emoji 🎉👍🏽, math ∑∫√",
    "   leading and trailing spaces   ",
    "<|im_start|> and <|eot_id|> as plain text",
    "",
)
MESSAGES: list[Any] = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Say hi in Català."},
    {"role": "assistant", "content": "Hola!"},
    {"role": "user", "content": [{"type": "text", "text": "Again, "}, {"type": "text", "text": "please."}]},
]


@pytest.fixture(scope="module")
def tiny_models(model_dirs: dict[str, Path]) -> dict[str, Path]:
    """The session's `tiny` models (conftest), one per architecture, created with the defaults."""
    assert set(model_dirs) == set(ARCHITECTURES)
    return model_dirs


def _read_json(path: Path) -> dict[str, Any]:
    data: dict[str, Any] = json.loads(path.read_text(encoding="utf-8"))
    return data


def _render(tokenizer: Any, messages: list[Any], add_generation_prompt: bool) -> str:
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
    assert isinstance(text, str)
    return text


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_tiny_model_loads_with_transformers(tiny_models: dict[str, Path], arch: str) -> None:
    model_dir = tiny_models[arch]
    assert sorted(p.name for p in model_dir.iterdir()) == sorted(MODEL_FILES)
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    assert type(model).__name__ == MODEL_CLASSES[arch]
    assert isinstance(tokenizer, PreTrainedTokenizerFast)
    config = model.config
    assert (config.hidden_size, config.num_hidden_layers, config.num_key_value_heads) == (64, 2, 2)
    assert config.vocab_size == len(tokenizer) == 1024
    assert config.tie_word_embeddings is False
    with safe_open(str(model_dir / "model.safetensors"), framework="pt") as weights:
        assert {"lm_head.weight", "model.embed_tokens.weight"} <= set(weights.keys())
    eot = tokenizer.convert_tokens_to_ids(END_OF_TURN[arch])
    assert tokenizer.eos_token == END_OF_TURN[arch]
    assert config.eos_token_id == eot
    generation = _read_json(model_dir / "generation_config.json")
    assert eot in generation["eos_token_id"]
    assert generation["pad_token_id"] == tokenizer.pad_token_id
    assert generation["bos_token_id"] == config.bos_token_id


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_tokenizer_round_trips_text(tiny_models: dict[str, Path], arch: str) -> None:
    tokenizer = AutoTokenizer.from_pretrained(tiny_models[arch])
    raw = Tokenizer.from_file(str(tiny_models[arch] / "tokenizer.json"))
    for text in TEXTS:
        ids = tokenizer.encode(text, add_special_tokens=False)
        assert tokenizer.decode(ids) == text
        assert raw.encode(text, add_special_tokens=False).ids == ids
    # Special-token strings in text are matched as special tokens (as in Qwen and Llama 3).
    assert tokenizer.encode(tokenizer.pad_token, add_special_tokens=False) == [tokenizer.pad_token_id]


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_tokenizer_round_trips_arbitrary_text(tiny_models: dict[str, Path], arch: str) -> None:
    tokenizer = Tokenizer.from_file(str(tiny_models[arch] / "tokenizer.json"))

    @settings(max_examples=300, deadline=None)
    @given(st.text(max_size=200))
    def check(text: str) -> None:
        if arch != "llama":  # Qwen tokenizers NFC-normalize their input, like the real ones
            text = unicodedata.normalize("NFC", text)
        if "<|" in text:
            return
        ids = tokenizer.encode(text, add_special_tokens=False).ids
        assert tokenizer.decode(ids, skip_special_tokens=False) == text

    check()


def test_llama_tokenizer_adds_bos_once(tiny_models: dict[str, Path]) -> None:
    tokenizer = AutoTokenizer.from_pretrained(tiny_models["llama"])
    ids = tokenizer.encode("hi")
    assert ids[0] == tokenizer.bos_token_id and ids.count(tokenizer.bos_token_id) == 1
    chat_ids = tokenizer.encode(_render(tokenizer, MESSAGES[:2], True), add_special_tokens=False)
    assert chat_ids.count(tokenizer.bos_token_id) == 1 and chat_ids[0] == tokenizer.bos_token_id
    qwen = AutoTokenizer.from_pretrained(tiny_models["qwen3"])
    assert qwen.bos_token is None
    assert qwen.encode("hi") == qwen.encode("hi", add_special_tokens=False)


def test_chat_templates_render(tiny_models: dict[str, Path]) -> None:
    llama = AutoTokenizer.from_pretrained(tiny_models["llama"])
    assert _render(llama, MESSAGES, True) == (
        "<|begin_of_text|>"
        "<|start_header_id|>system<|end_header_id|>\n\nYou are terse.<|eot_id|>"
        "<|start_header_id|>user<|end_header_id|>\n\nSay hi in Català.<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\nHola!<|eot_id|>"
        "<|start_header_id|>user<|end_header_id|>\n\nAgain, please.<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\n"
    )
    for arch in ("qwen2", "qwen3"):
        qwen = AutoTokenizer.from_pretrained(tiny_models[arch])
        assert _render(qwen, MESSAGES[:2], True) == (
            "<|im_start|>system\nYou are terse.<|im_end|>\n"
            "<|im_start|>user\nSay hi in Català.<|im_end|>\n"
            "<|im_start|>assistant\n"
        )
        assert _render(qwen, MESSAGES[:2], False).endswith("Català.<|im_end|>\n")


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_greedy_generation_is_not_degenerate(tiny_models: dict[str, Path], arch: str) -> None:
    model = AutoModelForCausalLM.from_pretrained(tiny_models[arch]).eval()
    tokenizer = AutoTokenizer.from_pretrained(tiny_models[arch])
    inputs = tokenizer("The quick brown fox jumps over the lazy dog.", return_tensors="pt")
    with torch.no_grad():
        out = model.generate(
            **inputs,
            max_new_tokens=20,
            min_new_tokens=20,
            do_sample=False,
            output_logits=True,
            return_dict_in_generate=True,
        )
    generated = out.sequences[0, inputs["input_ids"].shape[1] :].tolist()
    assert len(generated) == 20
    assert len(set(generated)) >= 10, generated
    top2 = torch.stack([logits[0].topk(2).values for logits in out.logits])
    assert (top2[:, 0] - top2[:, 1]).median() > 0.05  # greedy choices are not decided by rounding noise


def test_creation_is_deterministic(tiny_models: dict[str, Path], tmp_path: Path) -> None:
    again = create_model("qwen3", "tiny", tmp_path / "again")
    for name in MODEL_FILES:
        assert (again / name).read_bytes() == (tiny_models["qwen3"] / name).read_bytes(), name
    other_seed = create_model("qwen3", "tiny", tmp_path / "seed1", seed=1)
    assert (other_seed / "model.safetensors").read_bytes() != (again / "model.safetensors").read_bytes()
    assert (other_seed / "tokenizer.json").read_bytes() == (again / "tokenizer.json").read_bytes()


def test_bfloat16_model_is_the_float32_model_rounded(tiny_models: dict[str, Path], tmp_path: Path) -> None:
    bf16_dir = create_model("llama", "tiny", tmp_path / "bf16", dtype="bfloat16")
    assert _read_json(bf16_dir / "config.json")["dtype"] == "bfloat16"
    bf16 = AutoModelForCausalLM.from_pretrained(bf16_dir, dtype="auto")
    fp32 = AutoModelForCausalLM.from_pretrained(tiny_models["llama"])
    assert bf16.dtype == torch.bfloat16
    for name, weight in fp32.state_dict().items():
        assert torch.equal(bf16.state_dict()[name], weight.to(torch.bfloat16)), name


@pytest.mark.parametrize(
    ("kwargs", "bad"),
    [
        ({"arch": "gpt2", "preset": "tiny"}, "arch"),
        ({"arch": "llama", "preset": "huge"}, "preset"),
        ({"arch": "llama", "preset": "tiny", "dtype": "int8"}, "dtype"),
    ],
)
def test_bad_arguments_raise_value_error(tmp_path: Path, kwargs: dict[str, Any], bad: str) -> None:
    with pytest.raises(ValueError, match=bad):
        create_model(out_dir=tmp_path / "m", **kwargs)
    assert not (tmp_path / "m").exists()


def test_default_model_dir_respects_environment(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv("KVYARD_CACHE_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert default_model_dir() == tmp_path / "xdg" / "kvyard" / "models" / "llama-bench-v1"
    monkeypatch.setenv("KVYARD_CACHE_DIR", str(tmp_path / "kv"))
    assert default_model_dir("qwen3", "tiny") == tmp_path / "kv" / "models" / "qwen3-tiny-v1"
    with pytest.raises(ValueError, match="preset"):
        default_model_dir("llama", "huge")


def test_ensure_default_model_creates_once(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("KVYARD_CACHE_DIR", str(tmp_path))
    path = ensure_default_model("qwen2", "tiny")
    assert path == tmp_path / "models" / "qwen2-tiny-v1"
    assert sorted(p.name for p in path.iterdir()) == sorted(MODEL_FILES)
    stamp = (path / "model.safetensors").stat().st_mtime_ns
    assert ensure_default_model("qwen2", "tiny") == path
    assert (path / "model.safetensors").stat().st_mtime_ns == stamp
    assert [p.name for p in path.parent.iterdir()] == [path.name]  # no temporary directories left


def test_ensure_default_model_loses_race_cleanly(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("KVYARD_CACHE_DIR", str(tmp_path))
    target = default_model_dir("llama", "tiny")
    real_create = create.create_model

    def create_while_another_process_finishes_first(arch: str, preset: str, out_dir: Path) -> Path:
        real_create(arch, preset, out_dir)
        target.mkdir()
        (target / "config.json").write_text("{}")
        return out_dir

    monkeypatch.setattr(create, "create_model", create_while_another_process_finishes_first)
    assert ensure_default_model("llama", "tiny") == target
    assert (target / "config.json").read_text() == "{}"  # the winner's copy is kept
    assert [p.name for p in target.parent.iterdir()] == [target.name]


def test_cli_writes_model(tmp_path: Path) -> None:
    assert create.main(["--arch", "qwen2", "--preset", "tiny", "--out", str(tmp_path / "cli")]) == 0
    assert (tmp_path / "cli" / "model.safetensors").is_file()
