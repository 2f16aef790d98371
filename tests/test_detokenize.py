"""Streaming detokenisation: pushing tokens in any chunking yields exactly the full decode, multi-byte characters
split across rounds included."""

from __future__ import annotations

import random

import pytest

from shared.models import load_tokenizer
from verifier_node.detokenize import MAX_HELD, IncrementalText

pytestmark = pytest.mark.unit

TEXTS = ["def add(a, b):\n    return a + b\n", "héllo wörld ✓ — 日本語 done", "x = 1  # ünïcode ✓✓✓"]


# Blocks of 1-4 tokens, and of 1-10 as a verifier round commits (k + 1 tokens: more than the hold-back bound, ending
# anywhere in a character).
@pytest.mark.parametrize("most", [4, 10])
@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("seed", range(5))
def test_chunks_concatenate_to_the_full_decode(tokenizer_dir, text, seed, most):
    tokenizer = load_tokenizer(str(tokenizer_dir))
    ids = tokenizer(text)["input_ids"]
    rng = random.Random(seed)
    stream = IncrementalText(tokenizer)
    out, i = [], 0
    while i < len(ids):
        n = rng.randint(1, most)
        out.append(stream.push(ids[i : i + n]))
        i += n
    assert "".join(out) == tokenizer.decode(ids, skip_special_tokens=True) == text
    assert all("\ufffd" not in chunk for chunk in out)


class CountingTokenizer:
    """Delegates to a real tokenizer and counts the tokens each ``decode`` is given."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.decoded = 0

    def decode(self, ids, **kwargs) -> str:
        self.decoded += len(ids)
        return self.tokenizer.decode(ids, **kwargs)


@pytest.mark.parametrize("chunk", [1, 2, 3, 7])
def test_output_that_stays_u_fffd_decodes_in_linear_time(tokenizer_dir, chunk):
    # 0xff never starts a UTF-8 character: every round's text ends in U+FFFD, which was held back (and re-decoded
    # with the growing window) forever.
    tokenizer = load_tokenizer(str(tokenizer_dir))
    byte_ff = tokenizer.convert_tokens_to_ids("ÿ")
    counting = CountingTokenizer(tokenizer)
    stream = IncrementalText(counting)
    rounds = 600
    out = [stream.push([byte_ff] * chunk) for _ in range(rounds)]
    n = rounds * chunk
    assert counting.decoded <= 40 * n
    streamed = "".join(out)
    assert set(streamed) == {"\ufffd"} and len(streamed) >= n - MAX_HELD  # only the last few tokens still held
    assert sum(1 for piece in out if piece) >= rounds // 4  # it streams, not one burst at the end


def test_genuine_u_fffd_text_streams_exactly(tokenizer_dir):
    # The model writing U+FFFD itself (3 bytes each), then ordinary multi-byte text: all of it comes through.
    tokenizer = load_tokenizer(str(tokenizer_dir))
    text = "\ufffd" * 40 + "日本語 ✓ héllo"
    ids = tokenizer(text)["input_ids"]
    counting = CountingTokenizer(tokenizer)
    stream = IncrementalText(counting)
    out = [stream.push([token]) for token in ids]
    assert "".join(out) == text
    assert counting.decoded <= 40 * len(ids)
