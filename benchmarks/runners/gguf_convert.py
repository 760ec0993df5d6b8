"""Convert an HF model directory to GGUF with llama.cpp's own converter.

Runs in the ``llamacpp`` peer venv:

    python gguf_convert.py --llama-cpp-dir <sdist>/vendor/llama.cpp MODEL_DIR --outtype f16 --outfile OUT.gguf

llama.cpp's ``convert_hf_to_gguf.py`` identifies a BPE tokenizer's
pre-tokenizer by hashing how it splits a test string, and refuses a tokenizer
whose hash it does not know. kvyard's tokenizer uses Qwen2's split regex, so at
run time (nothing in llama.cpp is modified) an unrecognized hash maps to
``$KVYARD_GGUF_PRE`` (default ``qwen2``). Other arguments go to the converter.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path
from typing import Any


def patch_pre_tokenizer(fallback: str) -> None:
    from conversion.base import TextModel

    original = TextModel.get_vocab_base_pre

    def get_vocab_base_pre(self: Any, tokenizer: Any) -> str:
        try:
            return original(self, tokenizer)
        except NotImplementedError:
            logging.getLogger(__name__).warning("unknown BPE pre-tokenizer: using %r", fallback)
            return fallback

    TextModel.get_vocab_base_pre = get_vocab_base_pre


def main() -> None:
    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument("--llama-cpp-dir", required=True, type=Path)
    args, rest = parser.parse_known_args()
    root = args.llama_cpp_dir.resolve()
    sys.path[:0] = [str(root), str(root / "gguf-py")]
    patch_pre_tokenizer(os.environ.get("KVYARD_GGUF_PRE", "qwen2"))
    import convert_hf_to_gguf

    sys.argv = [str(root / "convert_hf_to_gguf.py"), *rest]
    convert_hf_to_gguf.main()


if __name__ == "__main__":
    main()
