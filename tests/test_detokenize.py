"""Streaming detokenisation: pushing tokens in any chunking yields exactly the full decode, multi-byte characters
split across rounds included."""

from __future__ import annotations

import random

import pytest

from shared.models import load_tokenizer
from verifier_node.detokenize import IncrementalText

pytestmark = pytest.mark.unit

TEXTS = ["def add(a, b):\n    return a + b\n", "héllo wörld ✓ — 日本語 done", "x = 1  # ünïcode ✓✓✓"]


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("seed", range(5))
def test_chunks_concatenate_to_the_full_decode(tokenizer_dir, text, seed):
    tokenizer = load_tokenizer(str(tokenizer_dir))
    ids = tokenizer(text)["input_ids"]
    rng = random.Random(seed)
    stream = IncrementalText(tokenizer)
    out, i = [], 0
    while i < len(ids):
        n = rng.randint(1, 4)
        out.append(stream.push(ids[i : i + n]))
        i += n
    assert "".join(out) == tokenizer.decode(ids, skip_special_tokens=True) == text
    assert all("\ufffd" not in chunk for chunk in out)
