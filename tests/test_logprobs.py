"""Log probabilities without node processes: the request parameter's bounds, the wire checks, token bytes from a
byte-level BPE tokenizer, the client's chunk merging, the HTTP release rule under stop strings, and a verifier
``Session`` over chain and tree rounds whose numbers must equal ``log_softmax`` of transformers' own scores for the
target (drafted, correction and bonus tokens alike). The end-to-end checks are in tests/test_logprobs_e2e.py."""

from __future__ import annotations

import math

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from http_server.logprobs import ShownLogprobs, completion_body, requested
from runtime.client import _Inbox
from runtime.logprobs import TokenLogprob, from_wire
from shared.backend import DynamicBackend
from shared.protocol import Chunk, Done, ProtocolError, decode, encode
from shared.protocol import TokenLogprob as WireLogprob
from shared.sampling import GenerationParams, ParamError
from verifier_node.logprobs import TokenPieces, committed_logprobs
from verifier_node.session import Session

pytestmark = pytest.mark.unit


def test_the_parameter_takes_0_to_20_and_stays_away_from_drafters():
    for good in (None, 0, 5, 20):
        assert GenerationParams.from_dict({"logprobs": good}).logprobs == good
    for bad in (21, -1, True, 2.0, "3"):
        with pytest.raises(ParamError, match="logprobs"):
            GenerationParams.from_dict({"logprobs": bad})
    params = GenerationParams(logprobs=3)
    assert "logprobs" in params.to_dict() and "logprobs" not in params.for_drafter()
    GenerationParams.from_dict(params.for_drafter())  # what a drafter parses


def test_the_wire_carries_one_checked_entry_per_token():
    entry = WireLogprob(-0.25, b"\xe2\x82", False, [7, 9], [-0.25, -1.5], [b"\xe2\x82", b"ab"])
    msg = decode(encode(Chunk(request_id=1, token_ids=[7], text="", logprobs=[entry])))
    assert msg.logprobs == [entry] and decode(encode(Chunk(request_id=1, token_ids=[7], text=""))).logprobs is None
    bad = [
        Chunk(request_id=1, token_ids=[7, 8], text="", logprobs=[entry]),  # one entry for two tokens
        Done(request_id=1, token_ids=[7], text="", metrics={}, finish_reason="stop",
             logprobs=[WireLogprob(-math.inf)]),  # -inf: the emitted token is always finite
        Chunk(request_id=1, token_ids=[7], text="", logprobs=[WireLogprob(0.5)]),  # above 0
        Chunk(request_id=1, token_ids=[7], text="", logprobs=[WireLogprob(-1.0, top_ids=[1], top_logprobs=[])]),
        Chunk(request_id=1, token_ids=[7], text="", logprobs=[
            WireLogprob(-1.0, top_ids=list(range(21)), top_logprobs=[-1.0] * 21, top_pieces=[b""] * 21)]),
    ]
    for msg in bad:
        with pytest.raises(ProtocolError, match="logprob"):
            decode(encode(msg))


def test_token_pieces_are_the_raw_bytes_of_byte_level_bpe(tokenizer_dir):
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    pieces = TokenPieces(tokenizer)
    assert pieces.byte_level
    text = "def add(a, b): é€ 😀"  # characters of 2, 3 and 4 bytes, split over byte tokens
    ids = tokenizer.encode(text, add_special_tokens=False)
    got = [pieces.piece(i) for i in ids]
    assert b"".join(p for p, _ in got) == text.encode("utf-8") and not any(s for _, s in got)
    assert any(p and p.decode("utf-8", "replace") != p.decode("utf-8", "ignore") for p, _ in got)  # a partial one
    assert pieces.piece(tokenizer.eos_token_id) == (b"<eos>", True)


def test_committed_logprobs_leave_out_excluded_alternatives():
    scores = torch.tensor([[0.0, 1.0, -math.inf, 2.0], [3.0, -math.inf, -math.inf, -math.inf]])
    out = committed_logprobs(scores, [0, 1], [1, 0], top_n=3)
    want = torch.log_softmax(scores[0], -1)
    assert out[0].token == 1 and out[0].logprob == pytest.approx(float(want[1]))
    assert out[0].top_ids == [3, 1, 0] and out[0].top_logprobs == pytest.approx(want[[3, 1, 0]].tolist())
    assert out[1].logprob == 0.0 and out[1].top_ids == [0]  # three asked, one finite
    assert committed_logprobs(scores, [0], [3], top_n=0)[0].top_ids == []
    # an excluded token committed (greedy ensemble verification can): the lowest finite float, which the wire takes
    (lowest,) = committed_logprobs(scores, [1], [2], top_n=2)
    assert lowest.logprob == torch.finfo(torch.float32).min and lowest.top_ids == [0]
    WireLogprob(lowest.logprob).check("test")


async def test_merged_chunks_keep_every_tokens_logprobs():
    inbox = _Inbox(limit=1)
    for i in range(3):
        inbox.put_nowait(Chunk(request_id=1, token_ids=[i], text=str(i), logprobs=[WireLogprob(-float(i))]))
    merged = await inbox.get()
    assert merged.token_ids == [0, 1, 2] and [e.logprob for e in merged.logprobs] == [0.0, -1.0, -2.0]


def test_stop_strings_show_only_the_tokens_that_begin_in_the_shown_text():
    pieces = [b"ab", b"\xc3", b"\xa9c", b"\xff", b"d!"]  # é split over two tokens, an invalid byte (U+FFFD)
    entries = from_wire([1, 2, 3, 4, 5, 0], [*(WireLogprob(-0.1 * i, p) for i, p in enumerate(pieces)),
                                              WireLogprob(-0.4, b"<eos>", True)])
    shown = ShownLogprobs()
    shown.add(entries)
    assert b"".join(pieces).decode("utf-8", "replace") == "abéc\ufffdd!"
    shown.shown(2)  # "ab"
    assert [e.id for e, _ in shown.take()] == [1]
    shown.shown(3)  # "abé": both halves of é
    assert [e.id for e, _ in shown.take()] == [2, 3]
    shown.shown(6)  # a stop "!" cut inside token 5: it is listed, the end token after it is not
    assert [e.id for e, _ in shown.take()] == [4, 5]
    body = completion_body(shown.released)
    assert body["tokens"] == ["ab", "\ufffd", "\ufffdc", "\ufffd", "d!"] and body["text_offset"] == [0, 2, 2, 4, 5]
    shown.shown(None)  # the end without a stop: everything
    assert [e.id for e, _ in shown.take()] == [0]


@pytest.mark.parametrize(("chat", "logprobs", "top", "param"), [
    (True, True, 21, "top_logprobs"), (True, 1, None, "logprobs"), (True, "yes", None, "logprobs"),
    (True, None, 2, "top_logprobs"), (True, False, 2, "top_logprobs"), (False, 21, None, "logprobs"),
    (False, True, None, "logprobs"), (False, 2, 2, "top_logprobs"),
])
def test_bad_http_values_name_their_field(chat, logprobs, top, param):
    from http_server.errors import OpenAIError

    with pytest.raises(OpenAIError) as info:
        requested(chat, logprobs, top)
    assert info.value.status == 400 and info.value.body()["error"]["param"] == param


def test_good_http_values():
    assert requested(True, True, 20) == 20 and requested(True, True, None) == 0
    assert requested(True, False, None) is None and requested(True, None, None) is None
    assert requested(False, 0, None) == 0 and requested(False, 20, None) == 20 and requested(False, None, None) is None


# ------------------------------------------------------------------------------------ a Session against transformers
@pytest.fixture(scope="module")
def target_lm(tiny):
    folder = tiny("llama", "target")
    model = AutoModelForCausalLM.from_pretrained(folder, attn_implementation="sdpa", dtype=torch.float32).eval()
    return model, AutoTokenizer.from_pretrained(folder)


def reference(model, prompt: list[int], n: int) -> tuple[list[int], torch.Tensor]:
    """transformers' greedy ``generate`` on the target alone: its tokens and ``log_softmax`` of its scores."""
    ids = torch.tensor([prompt])
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False,
                         eos_token_id=[], pad_token_id=1, output_scores=True, return_dict_in_generate=True)
    return out.sequences[0, len(prompt):].tolist(), torch.log_softmax(torch.stack(out.scores)[:, 0].float(), -1)


def check(entries: list[TokenLogprob], tokens: list[int], want: torch.Tensor, top_n: int) -> None:
    assert [e.id for e in entries] == tokens
    for e, row in zip(entries, want):
        assert abs(e.logprob - float(row[e.id])) < 1e-5
        assert [t.id for t in e.top] == row.topk(top_n).indices.tolist()
        assert max(abs(t.logprob - float(row[t.id])) for t in e.top) < 1e-5


def test_session_rounds_score_drafts_corrections_and_bonus_tokens_as_transformers_does(target_lm):
    model, tokenizer = target_lm
    prompt = [5, 17, 33, 2, 60]
    want, logprobs = reference(model, prompt, 14)
    s = Session(1, DynamicBackend(model), tokenizer, prompt, GenerationParams(max_new_tokens=14, logprobs=4), b"", 1)
    s.prefill()
    pieces = TokenPieces(tokenizer)
    from verifier_node.logprobs import to_wire

    got = []
    wrong = (want[0] + 1) % 100
    rounds = [
        ([wrong, want[0], want[1]], [-1, -1, 0]),  # tree: a side leaf accepted, then its child
        ([want[2], (want[2] + 1) % 100, want[3]], [-1, -1, 0]),  # tree: the chain accepted, then the bonus
        ([want[5], (want[6] + 1) % 100], None),  # chain: one accepted, then a correction
        ([want[7], want[8]], None),  # chain: both accepted, then the bonus
        ([*want[10:14], 7], [-1, 0, 1, 2, 3]),  # tree cut to the budget
    ]
    for draft, parents in rounds:
        r = s.verify(draft, None, parents=parents)
        assert r.logprobs is not None and len(r.logprobs) == len(r.tokens)
        got.extend(from_wire(r.tokens, to_wire(r.logprobs, pieces)))
    assert s.generated == want and s.finished == "length"
    check(got, want, logprobs, 4)
    plain = Session(2, DynamicBackend(model), tokenizer, prompt, GenerationParams(max_new_tokens=3), b"", 2)
    plain.prefill()
    assert plain.verify([want[0]], None).logprobs is None  # not asked: nothing computed


def test_a_done_past_the_header_cap_leaves_its_logprobs_to_the_chunks():
    from shared.protocol import MAX_HEADER_BYTES
    from verifier_node.logprobs import done_frames

    top = WireLogprob(-1.0, b"abcd", False, list(range(20)), [-1.0] * 20, [b"abcd"] * 20)
    small = Done(request_id=1, token_ids=[5] * 10, text="", metrics={}, finish_reason="length", logprobs=[top] * 10)
    assert decode(done_frames(small)).logprobs == [top] * 10
    n = 3000  # 20 alternatives each: past the 1 MiB header with them, far below without
    big = Done(request_id=1, token_ids=[5] * n, text="", metrics={}, finish_reason="length", logprobs=[top] * n)
    assert len(encode(big)[0]) > MAX_HEADER_BYTES
    frames = done_frames(big)
    assert len(frames[0]) <= MAX_HEADER_BYTES and decode(frames).logprobs is None and len(decode(frames).token_ids) == n


async def test_the_client_builds_the_results_logprobs_from_the_chunks_when_the_done_has_none():
    from runtime.client import AsyncClient, GenerationResult

    client = AsyncClient("ipc:///nowhere", timeout_s=5)
    inbox = _Inbox()
    entries = [WireLogprob(-0.5, b"a"), WireLogprob(-1.5, b"b"), WireLogprob(-2.5, b"c")]
    inbox.put_nowait(Chunk(request_id=1, token_ids=[1, 2], text="ab", logprobs=entries[:2]))
    inbox.put_nowait(Chunk(request_id=1, token_ids=[3], text="c", logprobs=entries[2:]))
    inbox.put_nowait(Done(request_id=1, token_ids=[1, 2, 3], text="abc", metrics={}, finish_reason="length"))
    items = [item async for item in client._replies(1, inbox, None)]
    result = items[-1]
    assert isinstance(result, GenerationResult) and [e.logprob for e in result.logprobs] == [-0.5, -1.5, -2.5]
    assert [e.id for e in result.logprobs] == [1, 2, 3] and items[0].logprobs[1].token == "b"
