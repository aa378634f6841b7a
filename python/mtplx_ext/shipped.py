"""The shipped model and the token conventions every tool shares (one definition each).

* `SHIPPED_MODEL`: the small trained qwen3 + MTP head folder inside the package;
* `EOS_TOKEN`: the end-of-text token the shipped tokenizer is trained with;
* `END_TOKENS` / `eos_ids`: the names end-of-text tokens go by in the
  tokenizers of the supported families, and their ids in a tokenizer;
* `DEFAULT_PROMPT` / `BENCH_PROMPTS`: code prompts like the shipped model's data.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

SHIPPED_MODEL = Path(__file__).resolve().parent / "assets" / "tiny-qwen3-mtp"

EOS_TOKEN = "<|endoftext|>"
END_TOKENS = (EOS_TOKEN, "<|im_end|>", "</s>", "<eos>")

DEFAULT_PROMPT = "import os\nimport sys\n\n\ndef main("

#: Prompts for `bench` (code, like the shipped model's training data); batch
#: B uses the first B, cycling.
BENCH_PROMPTS = (
    "def read_config(path):\n",
    "class Queue:\n    def __init__(self",
    "import os\nimport sys\n\n\ndef main(",
    "    for key, value in",
    "def _check_args(self, name",
    "try:\n    import",
    "    if not isinstance(",
    "class Error(Exception):\n",
)


def eos_ids(tokenizer: Any) -> tuple[int, ...]:
    """The ids of the end-of-text tokens a `tokenizers.Tokenizer` knows by name (sorted; () for None)."""
    if tokenizer is None:
        return ()
    ids = [tokenizer.token_to_id(n) for n in END_TOKENS]
    return tuple(sorted({i for i in ids if i is not None}))


__all__ = ["BENCH_PROMPTS", "DEFAULT_PROMPT", "END_TOKENS", "EOS_TOKEN", "SHIPPED_MODEL", "eos_ids"]
