"""Run llama.cpp's own convert_hf_to_gguf.py, teaching it nothing but our tokenizer's pre-tokenizer.

Usage: python -m bench.peers.convert_hf LLAMA_CPP_SRC [convert_hf_to_gguf.py arguments...]

The converter names a BPE tokenizer's pre-tokenizer by hashing how it encodes a
probe text against a table of known models; ignis' tiny tokenizer is trained
here, so its hash is in no table and the converter refuses. Its pre-tokenizer is
plain `ByteLevel(add_prefix_space=False, use_regex=True)` with no normalizer,
which splits with GPT-2's regex -- the same regex llama.cpp applies for the
"gpt-2" pre-tokenizer type (src/llama-vocab.cpp). So for exactly that
tokenizer.json shape, and only when the converter's own table has no answer, we
answer "gpt-2"; anything else still fails as the converter means it to.
"""

from __future__ import annotations

import json
import logging
import runpy
import sys
from pathlib import Path
from typing import Any

GPT2_PRE = "gpt-2"


def splits_like_gpt2(model_dir: Path) -> bool:
    """True when tokenizer.json is a byte-level BPE whose only pre-tokenizer is ByteLevel with GPT-2's regex."""
    path = Path(model_dir) / "tokenizer.json"
    if not path.is_file():
        return False
    data: dict[str, Any] = json.loads(path.read_text(encoding="utf-8"))
    pre = data.get("pre_tokenizer") or {}
    return (data.get("normalizer") is None and data.get("model", {}).get("type") == "BPE"
            and pre.get("type") == "ByteLevel" and bool(pre.get("use_regex", True))
            and not pre.get("add_prefix_space", False))


def main(argv: list[str]) -> None:
    src = Path(argv[0]).resolve()
    # The vendored gguf-py must win over any installed `gguf`: it matches this converter.
    sys.path[:0] = [str(src), str(src / "gguf-py")]
    from conversion.base import TextModel  # type: ignore[import-not-found]

    original = TextModel.get_vocab_base_pre
    converter_log = logging.getLogger("hf-to-gguf")

    def get_vocab_base_pre(self: Any, tokenizer: Any) -> str:
        # Quiet the converter's "not recognized" banner while asking its table first.
        disabled, converter_log.disabled = converter_log.disabled, True
        try:
            return str(original(self, tokenizer))
        except NotImplementedError:
            if not splits_like_gpt2(self.dir_model):
                raise
        finally:
            converter_log.disabled = disabled
        converter_log.warning("ignis: tokenizer.json pre-tokenizer is ByteLevel(use_regex=True), GPT-2's regex; "
                              "writing tokenizer.ggml.pre = %r", GPT2_PRE)
        return GPT2_PRE

    TextModel.get_vocab_base_pre = get_vocab_base_pre
    script = src / "convert_hf_to_gguf.py"
    sys.argv = [str(script), *argv[1:]]
    runpy.run_path(str(script), run_name="__main__")


if __name__ == "__main__":
    main(sys.argv[1:])
