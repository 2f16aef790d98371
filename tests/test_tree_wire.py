"""Token trees wired in, without node processes: the drafter's block layout, the cost schedule's tree plans, the
drafter's chain accounting of a tree's commit, and a verifier ``Session`` round over a tree (alone), which must
commit exactly what greedy decoding of the target would."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from drafter_node.base import DraftSession, DraftToken
from drafter_node.cost_model import CostBook
from drafter_node.node_session import NodeSession, tree_block
from drafter_node.schedule import CostSchedule
from runtime.config import ConfigError, load_config
from shared.backend import DynamicBackend
from shared.costs.curve import CostCurve
from shared.sampling import GenerationParams
from verifier_node.session import Session
from verifier_node.tree import DraftTree

pytestmark = pytest.mark.unit

FLAT = CostCurve(sizes=[1, 9, 17], seconds=[0.010, 0.012, 0.014], prefix_len=0)
DRAFT = CostCurve(sizes=[1, 17], seconds=[0.001, 0.004], prefix_len=0)
LINEAR = CostCurve(sizes=[1, 17], seconds=[0.010, 0.170], prefix_len=0)


def test_tree_block_puts_each_side_leaf_next_to_its_chain_token():
    tokens, parents = tree_block([10, 11, 12], {0: 20, 2: 22})
    assert tokens == [10, 20, 11, 12, 22]
    assert parents == [-1, -1, 0, 2, 2]
    tree = DraftTree(tokens, parents)
    tree.validate(64)
    assert tree.depths() == [1, 1, 2, 3, 3]
    assert tree_block([10, 11], {}) == ([10, 11], [-1, 0])


def book(verify: CostCurve) -> CostBook:
    b = CostBook(8)
    b.fix_curves(verify, DRAFT)
    return b


def test_the_cost_schedule_plans_side_leaves_only_when_asked_and_when_they_pay():
    tree = CostSchedule(4, 8, book(FLAT), lambda: 10, overlap=False, tree=True)
    assert tree.plan.sides and not tree.plan.overlap and all(i < tree.plan.k for i in tree.plan.sides)
    assert tree.plans["tree"] == 1
    chain = CostSchedule(4, 8, book(FLAT), lambda: 10, overlap=False)
    assert chain.plan.sides == () and chain.plans["tree"] == 0
    assert tree.plan.rate > chain.plan.rate
    # a verifier whose every token costs: no leaf pays (k = 0 even)
    assert CostSchedule(4, 8, book(LINEAR), lambda: 10, overlap=False, tree=True).plan.sides == ()


class _Chain(DraftSession):
    """A drafter whose chain is given (alt: its second choice at each position)."""

    def __init__(self, chain: list[DraftToken]):
        super().__init__([1, 2, 3], 3, GenerationParams(max_new_tokens=50))
        self.chain = list(chain)
        self.truncated: list[int] = []

    def propose(self, n: int) -> int:
        return 0

    def _truncate(self, length: int) -> None:
        self.truncated.append(length)


def test_a_commit_that_took_a_side_leaf_rolls_the_chain_back_and_counts_the_chain_only():
    chain = [DraftToken(10, alt=20), DraftToken(11, alt=21), DraftToken(12, alt=22)]
    draft = _Chain(chain)
    schedule = CostSchedule(3, 8, book(FLAT), lambda: len(draft.committed), overlap=False, tree=True)
    s = NodeSession(1, draft, schedule, schedule.book)
    schedule.plan = type(schedule.plan)(3, False, 0, 1.0, sides=(1,))
    schedule.k = 3
    tokens, tensors, idle, parents = s.block()
    assert (tokens, parents, idle, tensors) == ([10, 11, 21, 12], [-1, 0, 0, 1], 0, {})
    s.after_send()
    observed = []
    schedule.acc.observe = lambda drafted, accepted: observed.append((drafted, accepted))
    # the verifier took 10, then the side leaf 21, then its own 30: 3 tokens, path of 2 of the tree's 4 nodes
    s.on_commit([10, 21, 30], drafted=4, accepted=2, extras={})
    assert observed == [(3, 1)]  # the chain's first token accepted, its second rejected
    assert s.stats.side_accepted == 1 and s.stats.tree_blocks == 1
    assert draft.committed == [1, 2, 3, 10, 21, 30] and draft.chain == []
    assert draft.truncated == [3 + 1]  # rolled back behind the accepted chain token


def test_a_refused_tree_turns_trees_off_on_the_drafter_node():
    from types import SimpleNamespace

    from drafter_node.node_handlers import MessageHandler
    from drafter_node.node_picker import LinkPacer, WorkPicker
    from drafter_node.settings import DrafterConfig
    from shared.protocol import Error

    schedule = CostSchedule(4, 8, book(FLAT), lambda: 10, overlap=False, tree=True)
    picker = WorkPicker(max_batch_sessions=1, max_k=8)
    picker.add(SimpleNamespace(sid=1, schedule=schedule))
    link = LinkPacer()
    link.welcomed = True
    node = MessageHandler(DrafterConfig(tree=True), SimpleNamespace(), schedule.book, picker, link, rejoin=print)
    assert node.trees is True
    assert node.on_error(Error(message="no trees here", code="tree_refused")) is None  # goes on serving
    assert node.trees is False and schedule.tree is False


@pytest.fixture(scope="module")
def target_lm(tiny):
    folder = tiny("llama", "target")
    model = AutoModelForCausalLM.from_pretrained(folder, attn_implementation="sdpa").eval()
    return model, AutoTokenizer.from_pretrained(folder)


def greedy(model, prompt: list[int], n: int) -> list[int]:
    ids = list(prompt)
    with torch.inference_mode():
        for _ in range(n):
            ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt):]


def test_a_session_round_over_a_tree_commits_what_greedy_would(target_lm):
    model, tokenizer = target_lm
    prompt = [5, 17, 33, 2, 60]
    want = greedy(model, prompt, 12)
    s = Session(1, DynamicBackend(model), tokenizer, prompt, GenerationParams(max_new_tokens=12), b"", 1)
    s.prefill()
    wrong = (want[0] + 1) % 100
    # the chain's first token is wrong, its sibling (a side leaf) right; under the chain a right token to ignore
    r = s.verify([wrong, want[0], want[1]], None, parents=[-1, -1, 0])
    assert r.tokens == want[:2] and r.accepted == 1 and r.drafted == 3
    assert s.metrics.side_accepted == 1 and s.metrics.tree_rounds == 1
    assert s.metrics.per_position_drafted == [1, 1] and s.metrics.per_position_accepted == [1, 0]
    # a tree whose chain is right: the whole chain and the bonus
    r = s.verify([want[2], (want[2] + 1) % 100, want[3]], None, parents=[-1, -1, 0])
    assert r.tokens == want[2:5] and s.metrics.side_accepted == 1
    # a plain chain round after them: the cache holds exactly the committed prefix
    r = s.verify([want[5], want[6]], None)
    assert r.tokens == want[5:8]
    # cut to the budget: 4 tokens left, a tree of depth 5 is verified to depth 3
    r = s.verify([*want[8:12], 7], None, parents=[-1, 0, 1, 2, 3])
    assert r.tokens == want[8:12] and s.finished == "length"
    assert s.tokens[len(prompt):] == want


def test_drafter_tree_is_a_bool_key():
    assert load_config("cpu.yaml")["drafter"]["tree"] is False
    assert load_config("cpu.yaml", {"drafter.tree": True})["drafter"]["tree"] is True
    with pytest.raises(ConfigError, match=r"drafter\.tree"):
        load_config("cpu.yaml", {"drafter.tree": 1})


def test_session_stats_keep_the_wire_keys_the_verifier_checks():
    """The drafter's typed stats go on the wire as plain maps (``asdict``), with the keys the verifier checks."""
    from dataclasses import asdict, fields

    from drafter_node.node_session import SessionStats, SessionTiming
    from verifier_node.draft_check import _NUMERIC_STATS, checked_stats

    assert tuple(f.name for f in fields(SessionStats)) == _NUMERIC_STATS
    stats, timing = SessionStats(blocks=3, busy_s=0.5), SessionTiming(roundtrips=2)
    wire = {**asdict(stats), "timing": asdict(timing), "plans": {}, "dtype": "float32"}
    assert checked_stats(wire) is wire and wire["blocks"] == 3 and wire["timing"]["roundtrips"] == 2
    assert set(wire["timing"]) == {"step_s", "send_s", "commit_s", "roundtrip_s", "roundtrips", "forward_s",
                                   "profile_s"}
