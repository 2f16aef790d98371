"""Structured output on the verifier, in one process: the grammar parameter's checks, xgrammar's refusals as request
errors, the mask of every draft row with the matcher rolled back to the committed text, forced tokens drafted for
free, greedy rounds equal to transformers' ``generate`` with xgrammar's own logits processor (drafts accepted and
rejected), sampled rounds whose every output validates against its schema, and a grammar session batched beside a
plain one."""

from __future__ import annotations

import json
import random
import statistics
import sys
import time

import jsonschema
import numpy
import pytest
import torch
import xgrammar as xgr
from transformers import AutoModelForCausalLM, AutoTokenizer
from xgrammar.contrib.hf import LogitsProcessor

from shared.backend import DynamicBackend
from shared.batch import Row, feed_rows
from shared.costs.cache import CurveCheck
from shared.models import ThreadPlan
from shared.sampling import MAX_GRAMMAR_CHARS, GenerationParams, GrammarSpec, ParamError, structured_output
from verifier_node.grammar import GrammarCompiler, GrammarUnavailable, engine_message
from verifier_node.masks import MASK_STRIKES, GrammarTooSlow, MaskBudget
from verifier_node.rounds import RoundRunner, ThreadSwitch
from verifier_node.scheduler import BatchLimits, Scheduler
from verifier_node.session import Session

pytestmark = pytest.mark.unit

EOS = 0
SCHEMA = {
    "type": "object",
    "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 999},
                   "ok": {"type": "boolean"},
                   "tag": {"enum": ["red", "green", "blue"]}},
    "required": ["id", "ok", "tag"],
    "additionalProperties": False,
}
REGEX = r"(yes|no|maybe) [0-9]{1,3}"
PROMPTS = [[5, 17, 33, 2, 60], [100, 101, 7], [40, 41, 42, 43]]


@pytest.fixture(scope="module")
def target(tiny):
    folder = tiny("llama")
    return folder, AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval(), \
        AutoTokenizer.from_pretrained(folder)


@pytest.fixture(scope="module")
def compiler(target):
    _, model, tokenizer = target
    return GrammarCompiler(tokenizer, model.config.vocab_size, [EOS])


def _params(spec: GrammarSpec, **kw) -> GenerationParams:
    return GenerationParams.from_dict({"eos_token_ids": [EOS], "max_new_tokens": 48, "grammar": spec.to_wire(), **kw})


def _session(target, compiler, prompt, spec: GrammarSpec, sid: int = 1, **kw) -> Session:
    _, model, tokenizer = target
    params = _params(spec, **kw)
    s = Session(sid, DynamicBackend(model), tokenizer, prompt, params, b"c", sid,
                grammar=compiler.session(spec, params.end_token_ids))
    s.prefill()
    return s


def _reference(target, prompt: list[int], spec: GrammarSpec, max_new_tokens: int = 48) -> list[int]:
    """transformers' greedy ``generate`` on the target with xgrammar's logits processor, the same tokenizer info."""
    _, model, tokenizer = target
    info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=model.config.vocab_size, stop_token_ids=[EOS])
    c = xgr.GrammarCompiler(info)
    compiled = (c.compile_json_schema(spec.value, any_whitespace=False, strict_mode=True)
                if spec.kind == "json_schema" else c.compile_regex(spec.value))
    ids = torch.tensor([prompt])
    out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=max_new_tokens,
                         eos_token_id=[EOS], pad_token_id=1, logits_processor=[LogitsProcessor(compiled)])
    return out[0, len(prompt):].tolist()


def _text(target, tokens: list[int]) -> str:
    return target[2].decode(tokens, skip_special_tokens=True)


# ------------------------------------------------------------------------------------------ the parameter
def test_structured_output_maps_every_name_to_one_spec():
    schema = {"type": "object"}
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema, "strict": True}}
    assert structured_output(response_format=fmt) == GrammarSpec("json_schema", json.dumps(schema))
    assert structured_output(response_format={"type": "json_object"}) == GrammarSpec("json_object")
    assert structured_output(response_format={"type": "text"}) is None
    assert structured_output(json_schema='{"type": "string"}').value == '{"type": "string"}'
    assert structured_output(regex="a+").kind == "regex"
    assert structured_output(grammar='root ::= "a"').kind == "grammar"
    assert json.loads(structured_output(choice=["a", "b"]).value) == ["a", "b"]
    assert structured_output() is None


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"regex": "a", "grammar": 'root ::= "a"'}, "at most one output constraint"),
    ({"response_format": {"type": "xml"}}, "response_format type"),
    ({"response_format": {"type": "json_schema"}}, "needs \"json_schema\""),
    ({"choice": []}, "choice must be a list of 1 to"),
    ({"choice": "a"}, "choice must be a list"),
    ({"regex": ""}, "needs a non-empty value"),
    ({"regex": "a" * (MAX_GRAMMAR_CHARS + 1)}, "at most"),
])
def test_bad_constraints_are_param_errors(kwargs, message):
    with pytest.raises(ParamError, match=message):
        structured_output(**kwargs)


def test_grammar_parameter_checks():
    with pytest.raises(ParamError, match="kind must be one of"):
        GenerationParams.from_dict({"eos_token_ids": [0], "grammar": {"kind": "xml", "value": "x"}})
    with pytest.raises(ParamError, match="grammar must be"):
        GenerationParams.from_dict({"eos_token_ids": [0], "grammar": "a+"})
    with pytest.raises(ParamError, match="needs an end token"):
        GenerationParams.from_dict({"eos_token_ids": [], "grammar": {"kind": "regex", "value": "a"}})
    with pytest.raises(ParamError, match="min_new_tokens"):
        GenerationParams.from_dict({"eos_token_ids": [0], "min_new_tokens": 2,
                                    "grammar": {"kind": "regex", "value": "a"}})
    ok = GenerationParams.from_dict({"eos_token_ids": [0], "grammar": {"kind": "json_object"}})
    assert ok.grammar_spec == GrammarSpec("json_object")


# ------------------------------------------------------------------------------------------ engine refusals
@pytest.mark.parametrize(("spec", "message"), [
    (GrammarSpec("json_schema", '{"type": "integer", "minimum": 5, "maximum": 1}'), "minimum greater than maximum"),
    (GrammarSpec("json_schema", '{"type": "foo"}'), 'Unsupported type "foo"'),
    (GrammarSpec("json_schema", "not json"), "Failed to parse JSON"),
    (GrammarSpec("regex", "(ab"), "parenthesis is not closed"),
    (GrammarSpec("grammar", "root ::= missing"), 'Rule "missing" is not defined'),
])
def test_specs_the_engine_refuses_are_param_errors_with_its_message(compiler, spec, message):
    with pytest.raises(ParamError, match="refused by the grammar engine") as info:
        compiler.session(spec, {EOS})
    assert message in str(info.value)
    assert "/project/" not in str(info.value)  # the engine's source location is cut off


def test_impossible_schemas_are_refused(compiler):
    for schema, message in (({"enum": []}, "enum array must not be empty"),
                            ({"type": "string", "minLength": 5, "maxLength": 2}, "minLength 5 is greater"),
                            (False, "cannot accept any value")):
        with pytest.raises(ParamError, match=message):
            compiler.session(GrammarSpec("json_schema", json.dumps(schema)), {EOS})
    # one the engine compiles but that no text satisfies: refused before any round runs
    with pytest.raises(ParamError, match="allows no token at all"):
        compiler.session(GrammarSpec("regex", r"[^\s\S]"), {EOS})


def test_engine_message_drops_the_location_prefix():
    raw = RuntimeError("[12:07:59] /project/cpp/regex_converter.cc:94: Regex parsing error at position 2")
    assert engine_message(raw) == "Regex parsing error at position 2"


def test_missing_xgrammar_is_a_clear_param_error(target, monkeypatch):
    monkeypatch.setitem(sys.modules, "xgrammar", None)  # import xgrammar now raises ImportError
    _, model, tokenizer = target
    with pytest.raises(GrammarUnavailable, match=r"needs the xgrammar package.*pipespec\[structured\]"):
        GrammarCompiler(tokenizer, model.config.vocab_size, [EOS])
    assert issubclass(GrammarUnavailable, ParamError)  # the client's bad_request, the HTTP 400


def test_compiled_grammars_are_cached(compiler):
    spec = GrammarSpec("regex", REGEX)
    assert compiler.compile(spec) is compiler.compile(GrammarSpec("regex", REGEX))
    # per tenant (scope): no tenant learns from a quick answer that another compiled the same spec
    assert compiler.compile(spec, "tenant-a") is compiler.compile(spec, "tenant-a")
    assert compiler.compile(spec, "tenant-a") is not compiler.compile(spec, "tenant-b")
    assert compiler.compile(spec, "tenant-a") is not compiler.compile(spec)


# ------------------------------------------------------------------------------------------ masks and rollback
def _fresh_mask(compiler, spec, committed: list[int]) -> torch.Tensor:
    g = compiler.session(spec, {EOS})
    for t in committed:
        assert g.matcher.accept_token(t)
    return g.mask()


def test_plan_masks_each_row_and_commit_rolls_back_to_the_committed_text(compiler, target):
    spec = GrammarSpec("regex", REGEX)
    tok = target[2]
    g = compiler.session(spec, {EOS})
    yes = tok.encode("yes ", add_special_tokens=False)
    wrong = tok.encode("zz", add_special_tokens=False)
    plan = g.plan([*yes, *wrong], None, limit=10)
    # every row is the mask after the drafts before it; the first refused draft stays (to be rejected), then stops
    n = len(yes)
    assert plan.draft == [*yes, wrong[0]] and plan.advanced == n and plan.chain == n + 1
    assert len(plan.masks) == len(plan.draft) + 1
    for i in range(n + 1):
        assert torch.equal(plan.masks[i], _fresh_mask(compiler, spec, plan.draft[:i]))
    assert not plan.masks[n][wrong[0]] and int(plan.masks[n].sum()) > 1  # digits: a choice, nothing forced
    # the target accepted one draft and chose its own token: the matcher follows exactly that text
    own = int(plan.masks[1].nonzero()[-1, 0])
    g.commit(plan, [yes[0], own], accepted=1)
    assert torch.equal(g.mask(), _fresh_mask(compiler, spec, [yes[0], own]))


def test_forced_tokens_are_drafted_for_free(compiler, target):
    """After ``{"id": 1`` a schema with fixed keys forces ``, "ok": `` token by token: the plan appends them to an
    empty draft, and replaces a drafter token that differs (dropping the drafter's tokens after it)."""
    spec = GrammarSpec("json_schema", json.dumps(SCHEMA))
    tok = target[2]
    g = compiler.session(spec, {EOS})
    start = g.plan([], None, limit=20)
    assert start.forced > 0 and start.chain == 0  # '{"id": ' is forced from the first token
    assert tok.decode(start.draft).startswith('{"')
    one = tok.encode("1", add_special_tokens=False)[0]
    g.commit(start, [*start.draft, one], accepted=len(start.draft))
    assert torch.equal(g.mask(), _fresh_mask(compiler, spec, [*start.draft, one]))
    vocab = target[1].config.vocab_size
    other = compiler.session(spec, {EOS})
    plan = other.plan([7, 8, 9], torch.full((3, vocab), 1.0 / vocab), limit=20)
    assert plan.draft == start.draft and plan.chain == 0  # the drafter's tokens were refused: forced ones instead
    assert torch.equal(plan.q, torch.nn.functional.one_hot(torch.tensor(plan.draft), vocab).float())  # one-hot q
    assert plan.drafter_counts(len(plan.draft)) == (0, 0)  # forced tokens are not the drafter's acceptance


def test_limit_bounds_the_planned_draft(compiler):
    g = compiler.session(GrammarSpec("json_schema", json.dumps(SCHEMA)), {EOS})
    assert len(g.plan([], None, limit=2).draft) == 2


# ------------------------------------------------------------------------------------------ rounds
@pytest.mark.parametrize("spec", [GrammarSpec("json_schema", json.dumps(SCHEMA)), GrammarSpec("regex", REGEX)],
                         ids=["json_schema", "regex"])
def test_greedy_rounds_equal_generate_with_xgrammars_processor(target, compiler, spec):
    """Drafts right (the reference's own next tokens), wrong (random ids), partly right and refused by the grammar:
    both accepted and rejected drafts, and the output is exactly ``generate``'s with the same engine's processor."""
    rnd = random.Random(0)
    accepted = rejected = 0
    for prompt in PROMPTS:
        ref = _reference(target, prompt, spec)
        s = _session(target, compiler, prompt, spec)
        while not s.finished:
            n = len(s.generated)
            good = ref[n: n + 4]
            draft = rnd.choice([good, [rnd.randrange(2, 250) for _ in range(3)], [*good[:2], rnd.randrange(2, 250)]])
            r = s.verify(draft, None)
            accepted += r.accepted
            rejected += r.drafted - r.accepted
        assert s.generated == ref, f"prompt {prompt}"
        if spec.kind == "json_schema" and s.finished == "stop":
            jsonschema.validate(json.loads(_text(target, s.generated)), SCHEMA)
    assert accepted > 0 and rejected > 0


def test_sampled_outputs_all_validate(target, compiler):
    """Sampled (temperature 1.5, so the target ranges widely), drafts with q rows from a flat distribution: every
    finished output parses and validates against the schema."""
    spec = GrammarSpec("json_schema", json.dumps(SCHEMA))
    vocab = target[1].config.vocab_size
    rnd = random.Random(1)
    seen = set()
    accepted = rejected = 0
    for seed in range(12):
        s = _session(target, compiler, PROMPTS[seed % 3], spec, do_sample=True, temperature=1.5, seed=seed)
        while not s.finished:
            draft = [rnd.randrange(2, 250) for _ in range(rnd.randrange(0, 4))]
            r = s.verify(draft, torch.full((len(draft), vocab), 1.0 / vocab) if draft else None)
            accepted += r.accepted
            rejected += r.drafted - r.accepted
        assert s.finished == "stop"
        value = json.loads(_text(target, s.generated))
        jsonschema.validate(value, SCHEMA)
        seen.add(json.dumps(value, sort_keys=True))
    assert len(seen) > 3  # really sampled
    assert rejected > 0


def test_a_grammar_session_batched_beside_a_plain_one(target, compiler):
    """One forward over a grammar session and a plain one commits what each commits alone."""
    _, model, tokenizer = target
    spec = GrammarSpec("json_schema", json.dumps(SCHEMA))
    alone_g, alone_p = _session(target, compiler, PROMPTS[0], spec, sid=1), None
    params = GenerationParams.from_dict({"eos_token_ids": [], "max_new_tokens": 20})
    alone_p = Session(2, DynamicBackend(model), tokenizer, PROMPTS[1], params, b"c", 2)
    alone_p.prefill()
    for s in (alone_g, alone_p):
        while not s.finished:
            s.verify([9, 10], None)
    g = _session(target, compiler, PROMPTS[0], spec, sid=3)
    p = Session(4, DynamicBackend(model), tokenizer, PROMPTS[1], params, b"c", 4)
    p.prefill()
    while not (g.finished and p.finished):
        live = [s for s in (g, p) if not s.finished]
        plans = [s.plan_round([9, 10], None) for s in live]
        outs = feed_rows(model, [Row(s.lm, pl.fed) for s, pl in zip(live, plans)])
        for s, pl, o in zip(live, plans, outs):
            s.finish_round(pl, o.logits, None, 0.0, batch_sessions=len(live))
    assert g.generated == alone_g.generated and p.generated == alone_p.generated
    assert g.metrics.verify_batch_sum > g.metrics.rounds  # it did share forwards


def test_token_trees_fall_back_to_chains_under_a_grammar(target, compiler):
    s = _session(target, compiler, PROMPTS[0], GrammarSpec("regex", REGEX))
    plan = s.plan_round([5, 6, 7], None, parents=[-1, 0, -1])
    assert plan.tree is None and plan.grammar is not None


def test_hybrid_target_rolls_back_with_the_grammar(model_dir, tokenizer_dir):
    """An LFM2 target (short-convolution state: rolled back by snapshot and re-feed) under a JSON schema, greedy,
    drafts accepted and rejected: the output equals ``generate`` with xgrammar's processor."""
    from testkit.tiny_hybrid import build_hybrid

    folder = model_dir / "hybrid-lfm2-grammar"
    if not folder.exists():
        build_hybrid(folder, "lfm2", tokenizer_dir, seed=4)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(folder)
    hybrid = (folder, model, tokenizer)
    spec = GrammarSpec("json_schema", json.dumps(SCHEMA))
    compiler = GrammarCompiler(tokenizer, model.config.vocab_size, [EOS])
    rnd = random.Random(2)
    accepted = rejected = 0
    for prompt in PROMPTS[:2]:
        ref = _reference(hybrid, prompt, spec)
        s = _session(hybrid, compiler, prompt, spec)
        assert s.lm.recurrent
        while not s.finished:
            n = len(s.generated)
            draft = rnd.choice([ref[n: n + 3], [rnd.randrange(2, 250)], [*ref[n: n + 1], rnd.randrange(2, 250)]])
            r = s.verify(draft, None)
            accepted += r.accepted
            rejected += r.drafted - r.accepted
        assert s.generated == ref
    assert accepted > 0 and rejected > 0


def test_generate_flags_become_the_clients_constraint(tmp_path):
    from runtime.config import ConfigError
    from runtime.launch import _parser
    from runtime.launch_args import constraint as _constraint

    schema = tmp_path / "s.json"
    schema.write_text('{"type": "object"}')
    assert _constraint(_parser().parse_args(["--prompt", "x", "--json-schema", str(schema)])) == \
        {"json_schema": '{"type": "object"}'}
    assert _constraint(_parser().parse_args(["--prompt", "x", "--regex", "a+"])) == {"regex": "a+"}
    assert _constraint(_parser().parse_args(["--prompt", "x"])) == {}
    with pytest.raises(ConfigError, match="cannot read the schema"):
        _constraint(_parser().parse_args(["--prompt", "x", "--json-schema", str(tmp_path / "missing.json")]))
    with pytest.raises(SystemExit):  # one constraint at most
        _parser().parse_args(["--prompt", "x", "--regex", "a", "--json-schema", str(schema)])


def test_the_scheduler_does_not_wait_for_a_draft_where_the_grammar_forces_the_next_token(target, compiler):
    from types import SimpleNamespace

    from verifier_node.scheduler import Scheduler

    s = _session(target, compiler, PROMPTS[0], GrammarSpec("json_schema", json.dumps(SCHEMA)))
    s.announced, s.drafter = True, SimpleNamespace(alive=lambda now=None: True)
    assert s.grammar.next_is_forced()  # '{' first
    assert not Scheduler.may_wait(s, 0.0)
    while s.grammar.next_is_forced():
        s.verify([], None)  # a round with no draft commits every forced token, then the target's own
    assert Scheduler.may_wait(s, 0.0)  # a real choice: the drafter's block is worth waiting for
    plain = Session(9, DynamicBackend(target[1]), target[2], PROMPTS[0],
                    GenerationParams.from_dict({"eos_token_ids": [EOS]}), b"c", 9)
    plain.prefilled, plain.announced, plain.drafter = True, True, s.drafter
    assert Scheduler.may_wait(plain, 0.0)


# ------------------------------------------------------------------------------------------ masks within a budget
def test_mask_budget_shrinks_to_what_fits_then_grows_back():
    b = MaskBudget(0.010)
    assert b.record(0.004, 8) == "ok" and b.positions is None
    assert b.record(0.040, 8) == "shrunk"  # 5 ms a mask: one mask plus the bonus row's fits 10 ms
    assert b.positions == 1 and b.shrunk == 1
    assert b.record(0.012, 2) == "shrunk" and b.positions == 0  # always fewer than the round used
    assert b.record(0.004, 1) == "grown" and b.positions == 1  # well under: doubles (+1)
    assert b.record(0.008, 2) == "ok" and b.positions == 1  # under, not well under: stays
    for _ in range(6):
        b.record(0.001, 2)
    assert b.positions is None  # past GROW_LIMIT: no cap


def test_mask_budget_fails_only_after_strikes_in_a_row_at_one_mask():
    b = MaskBudget(0.010)
    verdicts = [b.record(0.050, 1) for _ in range(MASK_STRIKES - 1)]
    assert verdicts == ["over"] * (MASK_STRIKES - 1)
    assert b.record(0.001, 1) == "ok" and b.strikes == 0  # a round under the budget clears the strikes
    verdicts = [b.record(0.050, 1) for _ in range(MASK_STRIKES)]
    assert verdicts[-1] == "failed" and verdicts[:-1] == ["over"] * (MASK_STRIKES - 1)


def test_capped_positions_keep_greedy_rounds_exact(target, compiler):
    """A shrunk session (one position a round) commits exactly what ``generate`` does with the grammar."""
    spec = GrammarSpec("json_schema", json.dumps(SCHEMA))
    for prompt in PROMPTS[:2]:
        ref = _reference(target, prompt, spec)
        s = _session(target, compiler, prompt, spec)
        s.grammar.positions = 1
        while not s.finished:
            n = len(s.generated)
            r = s.verify(ref[n: n + 4], None)
            assert r.drafted <= 1 and len(r.tokens) <= 2
        assert s.generated == ref


class _SlowMatcher:
    """A matcher whose masks take ``delay_s`` each (an injected slow-mask schema); sleeping frees Python's lock as
    xgrammar's fill does."""

    def __init__(self, inner, delay_s: float):
        self.inner, self.delay_s = inner, delay_s
        self.fills: list[tuple[float, float]] = []  # (start, end) of each fill

    def fill_next_token_bitmask(self, bitmask, index: int = 0):
        start = time.monotonic()
        time.sleep(self.delay_s)
        out = self.inner.fill_next_token_bitmask(bitmask, index)
        self.fills.append((start, time.monotonic()))
        return out

    def longest_run(self) -> tuple[float, float]:
        """(start, end) of the longest run of back-to-back fills: a round's plan."""
        runs = [list(self.fills[:1])]
        for fill in self.fills[1:]:
            if fill[0] - runs[-1][-1][1] < 0.05:
                runs[-1].append(fill)
            else:
                runs.append([fill])
        run = max(runs, key=len)
        return run[0][0], run[-1][1]

    def __getattr__(self, name):
        return getattr(self.inner, name)


class _Out:
    """The server's side of the rounds, recorded: publish times, finishes, failures."""

    def __init__(self, scheduler):
        self.scheduler, self.times, self.failed, self.done = scheduler, {}, {}, {}

    def announce(self, s, hidden=None, kv=None):
        pass

    def publish(self, s, result, decoding):
        self.times.setdefault(s.sid, []).append(time.monotonic())

    def finish(self, s, reason):
        self.scheduler.remove(s)
        self.done[s.sid] = reason

    def round_failed(self, s, exc):
        self.scheduler.remove(s)
        self.failed[s.sid] = exc

    def demoted(self, s):
        pass


def _run(runner, scheduler, deadline_s: float = 60.0) -> None:
    end = time.monotonic() + deadline_s
    while scheduler.sessions and time.monotonic() < end:
        work = scheduler.next_work()
        if work:
            runner.run_batch(work)
        else:
            time.sleep(0.001)  # a plan on a mask worker
    assert not scheduler.sessions, "sessions left at the deadline"


def _runner(model, budget_s: float, delay_s: float = 0.0):
    scheduler = Scheduler(BatchLimits(True, 8, 1024, 512))
    out = _Out(scheduler)
    runner = RoundRunner(DynamicBackend(model), scheduler, out, ThreadSwitch(ThreadPlan(1, 1), apply=lambda n: None),
                         CurveCheck(None), forward_delay_s=delay_s, mask_budget_s=budget_s)
    return scheduler, out, runner


def _plain(target, sid: int, max_new: int) -> Session:
    _, model, tokenizer = target
    s = Session(sid, DynamicBackend(model), tokenizer, PROMPTS[1],
                GenerationParams.from_dict({"eos_token_ids": [], "max_new_tokens": max_new}), b"c", 100 + sid)
    s.prefill()
    return s


def test_a_shrunk_session_through_the_runner_equals_generate(target, compiler):
    """Masks of 4 ms against a 10 ms share: the session is shrunk, not failed, and its output is exact."""
    spec = GrammarSpec("json_schema", json.dumps(SCHEMA))
    scheduler, out, runner = _runner(target[1], budget_s=0.010)
    s = _session(target, compiler, PROMPTS[0], spec)
    s.grammar.matcher = _SlowMatcher(s.grammar.matcher, 0.004)
    scheduler.add(s)
    try:
        _run(runner, scheduler)
    finally:
        runner.masks.close()
    assert not out.failed and out.done
    assert s.grammar.budget.shrunk >= 1
    assert s.summary()["grammar_mask_ms"] >= 4 * len(s.grammar.matcher.fills)
    assert s.generated == _reference(target, PROMPTS[0], spec)


def test_a_slow_mask_session_is_shrunk_then_failed_while_a_plain_one_keeps_its_pace(target, compiler):
    """Masks of 250 ms against a 50 ms share: the session is shrunk, then fails with an error naming its request;
    a plain session beside it on the same runner keeps (within generous margins) the round gaps it has alone, and
    its output is unchanged. Filled on the loop, the slow session's first round (several masks, over a second)
    would have stalled the plain one as long: here the plain one runs rounds all through it."""
    spec = GrammarSpec("json_schema", json.dumps(SCHEMA))
    scheduler, out, runner = _runner(target[1], budget_s=0.050, delay_s=0.02)
    try:
        alone = _plain(target, 1, 60)
        scheduler.add(alone)
        _run(runner, scheduler)
        base = statistics.median(numpy.diff(out.times[1]))
        slow = _session(target, compiler, PROMPTS[0], spec, sid=2)
        slow.grammar.matcher = matcher = _SlowMatcher(slow.grammar.matcher, 0.250)
        beside = _plain(target, 3, 60)
        scheduler.add(slow)
        scheduler.add(beside)
        started = time.monotonic()
        _run(runner, scheduler)
    finally:
        runner.masks.close()
    exc = out.failed.get(2)
    assert isinstance(exc, GrammarTooSlow), out.failed
    assert f"request {slow.request_id}:" in str(exc) and "grammar_mask_budget_ms" in str(exc)
    budget = slow.grammar.budget
    assert budget.shrunk >= 1 and budget.positions == 0
    assert budget.worst_s >= 0.75  # its first round filled several masks (the forced '{"id":')
    assert beside.generated == alone.generated and out.done[3] == "length"
    gaps = numpy.diff([started, *out.times[3]])  # from the start: its first round waits for nobody's masks either
    assert statistics.median(gaps) < 2 * base + 0.010, (base, statistics.median(gaps))
    start, end = matcher.longest_run()
    assert end - start >= 0.75  # the first round's plan: several masks back to back
    during = sum(1 for t in out.times[3] if start < t < end)
    assert during >= 5, (during, end - start)  # filled on the loop: none
