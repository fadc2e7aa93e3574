"""Scheduler bookkeeping driven directly: plans are inspected and results are written by hand.

The model is not what these tests are about, so step results are made up (token ids chosen by the test);
everything else (allocator, slots, prefix cache, stop checks, lifecycle) is the real code.
"""

from __future__ import annotations

from dataclasses import replace

import pytest

from engine.config import EngineConfig, SpecAlgorithm, SpeculativeConfig
from engine.constraint import Constraint, ConstraintKind
from engine.errors import ProtocolError
from engine.finish import AbortCause, FinishReason
from engine.grammar_calls import CommitOutcome as GrammarOutcome
from engine.grammar_calls import CommitResult, Refusal, mask_refused, masks_unavailable
from engine.sampling_params import SamplingParams
from engine.scheduler.batch_verdict import regime
from engine.scheduler.request import IllegalTransitionError, Request, RequestState
from engine.scheduler.scheduler import CommitOutcome, Scheduler
from engine.scheduler.stop import StopChecker
from engine.step import SampledRun, StepPlan, StepResult, StepTiming

EOS = 2


def _req(rid: str, n_prompt: int, max_new: int = 4, **kw: object) -> Request:
    params = SamplingParams(temperature=0.0, max_new_tokens=max_new, **kw)  # type: ignore[arg-type]
    prompt = tuple(range(10, 10 + n_prompt))
    return Request(rid, prompt, params, StopChecker(params, frozenset({EOS}), None), seed=0)


def _result(plan: StepPlan, token: int = 7) -> StepResult:
    """One token per sampling entry (plain decoding: a decode samples the ordinal after the run it builds on)."""
    runs = tuple(SampledRun(e.request_id, e.ordinal + e.input_ref, (token,)) for e in plan.entries if e.sample)
    return StepResult(plan.step_id, runs)


def _commit(s: Scheduler, result: StepResult) -> CommitOutcome:
    """Both phases of a commit, for unconstrained requests (no grammar to ask)."""
    pending = s.commit(result)
    assert pending.grammar == []
    return s.finish_commit(pending, [])


def _sched(**kw: object) -> Scheduler:
    base = {"page_size": 4, "num_pages": 64, "max_running": 8, "chunk_size": 16}
    base.update(kw)
    return Scheduler(EngineConfig(**base))  # type: ignore[arg-type]


def _spec(drafts: int) -> SpeculativeConfig:
    return SpeculativeConfig(SpecAlgorithm.NGRAM, num_draft_tokens=drafts + 1, adaptive=False)


def _baseline(s: Scheduler) -> None:
    st = s.stats()
    assert st.free_pages + st.evictable_pages == st.total_pages
    assert st.reserved_pages == 0 and st.free_slots == st.total_slots and st.num_running == 0


def test_lifecycle_transitions_are_checked() -> None:
    r = _req("a", 3)
    with pytest.raises(IllegalTransitionError):
        r.transition(RequestState.DECODING)
    r.transition(RequestState.PREFILLING)
    r.transition(RequestState.DECODING)
    with pytest.raises(IllegalTransitionError):
        r.transition(RequestState.PREFILLING)


def test_chunked_prefill_plans_next_chunk_only_after_retire() -> None:
    """C10. Fails if `req.inflight_steps or` is removed from `Scheduler._plan_running` (chunk 2 is planned
    while chunk 1 is in flight): checked once by removing it."""
    s = _sched(chunk_size=5)
    s.add(_req("a", 12))
    p1 = s.plan()
    assert p1 is not None and [e.sample for e in p1.entries] == [False]  # middle chunk samples nothing
    assert s.plan() is None  # C10: chunk 2 waits until chunk 1's step retired
    _commit(s, _result(p1))
    p2 = s.plan()
    assert p2 is not None and p2.entries[0].input_ids == tuple(range(15, 20)) and not p2.entries[0].sample
    _commit(s, _result(p2))
    p3 = s.plan()
    assert p3 is not None and p3.entries[0].input_ids == tuple(range(20, 22)) and p3.entries[0].sample


def test_overlap_decode_refers_to_the_token_in_flight() -> None:
    s = _sched()
    s.add(_req("a", 3, max_new=3))
    p1 = s.plan()
    assert p1 is not None
    p2 = s.plan()  # planned while p1 is in flight
    assert p2 is not None
    e = p2.entries[0]
    assert e.input_ref and e.ordinal == 0 and e.input_ids == ()  # builds on p1's run, which begins at ordinal 0
    out = _commit(s, _result(p1, token=40))
    assert [o.new_token_ids for o in out.outputs] == [(40,)]
    p3 = s.plan()
    assert p3 is not None and p3.entries[0].ordinal == 1
    _commit(s, _result(p2, token=41))
    assert s.plan() is None  # max_new_tokens reached by what is in flight
    out = _commit(s, _result(p3, token=42))
    assert out.outputs[-1].finish is not None and out.outputs[-1].finish.reason is FinishReason.LENGTH
    assert out.outputs[-1].output_ids == (40, 41, 42)
    _baseline(s)


def test_stop_with_step_in_flight_drops_it_and_releases_after_retire() -> None:
    """C6 and C9. Fails if `if req.finishing: continue` is removed from `Scheduler.commit` (the token after
    the stop is appended and streamed) or if `_release_retired` ignores `inflight_steps` (the slot is freed
    while p2 still names it): checked once each."""
    s = _sched()
    s.add(_req("a", 3, max_new=10))
    p1 = s.plan()
    p2 = s.plan()
    assert p1 is not None and p2 is not None
    out = _commit(s, _result(p1, token=EOS))
    assert out.outputs[0].finish is not None and out.outputs[0].finish.reason is FinishReason.STOP
    assert out.released_slots == []  # C9: p2 still names the request
    assert s.stats().free_slots == 7
    out = _commit(s, _result(p2, token=99))
    assert out.outputs == [] and out.released_slots == [0]  # C6: nothing after the stop
    _baseline(s)


def test_abort_before_commit_drops_the_result() -> None:
    """C7, C8, C9. Fails if `if req.finishing: continue` is removed from `Scheduler.commit` (the aborted
    request gets a token), if `if req.finishing: return None, 0` is removed from `_plan_running` (it is
    planned again), or if `_finish_now` releases without checking `inflight_steps` (the slot goes while p1
    is in flight and the commit then finds no request): checked once each."""
    s = _sched()
    s.add(_req("a", 3))
    p1 = s.plan()
    assert p1 is not None
    out = s.abort("a")
    assert out.outputs[0].finish is not None and out.outputs[0].finish.reason is FinishReason.ABORT
    assert s.plan() is None  # C8: never planned again
    out = _commit(s, _result(p1))
    assert out.outputs == [] and out.released_slots == [0]
    assert s.abort("a").outputs == []  # twice: no-op
    _baseline(s)


def test_commit_out_of_order_or_wrong_ordinal_is_refused() -> None:
    """C1, C2. Fails if the step-order check at the top of `Scheduler.commit` is removed (p2 commits before p1)
    or if `Scheduler.commit` stops comparing a run's ordinal with the committed count: checked once each."""
    s = _sched()
    s.add(_req("a", 3))
    p1 = s.plan()
    p2 = s.plan()
    assert p1 is not None and p2 is not None
    with pytest.raises(ProtocolError, match="out of order"):
        _commit(s, _result(p2))
    bad = StepResult(p1.step_id, (SampledRun("a", 5, (1,)),))
    with pytest.raises(ProtocolError, match="C2"):
        _commit(s, bad)


def test_reservation_blocks_admission_until_pages_return() -> None:
    s = _sched(num_pages=6, prefix_cache=False)
    s.add(_req("a", 8, max_new=9))  # needs ceil(16 / 4) = 4 pages
    s.add(_req("b", 8, max_new=9))
    p = s.plan()
    assert p is not None and [e.request_id for e in p.entries] == ["a"]  # b would need 4 of the 2 left
    while p is not None:
        _commit(s, _result(p))
        p = s.plan()
        if p is not None and "b" in {e.request_id for e in p.entries}:
            break
    assert p is not None and s.stats().num_running == 1


def test_max_new_tokens_zero_finishes_without_resources() -> None:
    s = _sched()
    out = s.add(_req("a", 3, max_new=0))
    assert out.outputs[0].finish is not None and out.outputs[0].finish.reason is FinishReason.LENGTH
    assert s.plan() is None
    _baseline(s)


def test_watermark_bounds_the_prefix_cache() -> None:
    """C11. A 7-token prompt with one output token wrote KV for positions 0..6 only: one full page of 4 may be
    cached, not two. Fails if `_return_pages` inserts all prompt + output tokens instead of those below
    `kv_committed` (the second page, whose last slot was never written, becomes a prefix hit): checked once."""
    s = _sched()
    s.add(_req("a", 7, max_new=1))
    p = s.plan()
    assert p is not None
    _commit(s, _result(p))
    assert s.cache is not None and s.cache.num_cached == 1
    assert s.cache.match((*range(10, 17), 7)).num_tokens == 4
    _baseline(s)


def test_executor_lost_aborts_everything_and_drops_the_cache() -> None:
    s = _sched()
    s.add(_req("done", 9, max_new=1))
    p = s.plan()
    assert p is not None
    _commit(s, _result(p))
    assert s.cache is not None and s.cache.num_cached > 0
    s.add(_req("a", 5, max_new=5))
    s.add(_req("b", 5, max_new=5))
    assert s.plan() is not None and s.plan() is not None
    s.add(_req("queued", 5, max_new=5))
    out = s.executor_lost("executor unavailable: gone")
    finishes = {o.request_id: o.finish for o in out.outputs if o.finish is not None}
    assert set(finishes) == {"a", "b"}  # "queued" holds nothing of the executor's: it waits for the next session
    assert all(f.reason is FinishReason.ABORT and f.cause is AbortCause.EXECUTOR for f in finishes.values())
    assert out.released_slots == []  # the executor's buffers went with its session
    assert s.cache.num_cached == 0  # the KV behind every cached page is gone
    p = s.plan()
    assert p is not None and [e.request_id for e in p.entries] == ["queued"]
    _commit(s, _result(p))
    assert s.abort("queued").outputs and s.stats().num_running == 0


def _constrained(rid: str, session: int, n_prompt: int = 5) -> Request:
    req = _req(rid, n_prompt, max_new=5)
    req.constraint, req.grammar_session = REGEX, session
    return req


def test_executor_lost_releases_the_grammars_of_the_requests_it_ends() -> None:
    """A request the executor's loss ends is finished like any other for the grammar service: its grammar is released.
    Fails if Scheduler.executor_lost keeps only the outputs of its finishes (as it did until the chaos test caught the
    grammar service holding their matchers forever)."""
    s = _sched()
    s.add(_constrained("running", session=1))
    assert s.plan() is not None
    s.add(_constrained("queued", session=1))
    s.add(_req("free", 5))  # queued, like "queued": nothing planned them yet
    out = s.executor_lost("executor unavailable: gone")
    assert [o.request_id for o in out.outputs] == ["running"] and out.released_grammars == ["running"]


def test_a_lost_grammar_session_ends_only_the_requests_whose_grammar_lived_there() -> None:
    """Running or queued, a request whose grammar lived in a lost session ends with an abort caused by the grammar
    service, its slot and pages freed once no step names it (C9), and no grammar release asked of a service that lost
    them; a request in a later session, and one without a grammar, go on. Fails if Scheduler.grammar_lost compares
    sessions the other way or skips queued requests."""
    s = _sched(max_running=2)
    running = _constrained("old-running", session=1)
    s.add(running)
    s.add(_req("free", 5))
    plan = s.plan()
    assert plan is not None and len(plan.entries) == 2
    s.add(_constrained("old-queued", session=1))
    s.add(_constrained("new", session=2))
    out = s.grammar_lost(1, "grammar service unavailable: gone")
    ended = {o.request_id: o.finish for o in out.outputs}
    assert set(ended) == {"old-running", "old-queued"}, ended
    assert all(f is not None and f.cause is AbortCause.GRAMMAR_SERVICE for f in ended.values())
    assert out.released_grammars == [] and out.released_slots == []  # "old-running" is still in the step
    slot = running.slot
    assert _commit(s, _result(plan)).released_slots == [slot]  # its slot goes once the step retired
    assert s.has_request("new") and s.has_request("free") and not s.has_request("old-queued")


def test_expired_queued_requests_end_and_the_others_keep_waiting() -> None:
    s = _sched()
    early, late = _req("early", 5), _req("late", 5)
    early.queued_at, late.queued_at = 10.0, 20.0
    s.add(early)
    s.add(late)
    out = s.expire_queued(15.0, "executor unavailable: it did not come back within 5 s", AbortCause.EXECUTOR)
    assert [(o.request_id, o.finish.cause if o.finish else None) for o in out.outputs] == [
        ("early", AbortCause.EXECUTOR)
    ]
    assert s.stats().num_waiting == 1 and s.has_request("late")


# ---------------------------------------------------------------------------------------------------- runs (v2)

REGEX = Constraint(ConstraintKind.REGEX, "(yes|no)+")


def _decoding(s: Scheduler, rid: str, first: int = 5, **kw: object) -> StepPlan:
    """Admit ``rid``, commit its prefill (first token ``first``) and return its first decode plan."""
    s.add(_req(rid, 3, **kw))
    p = s.plan()
    assert p is not None
    pending = s.commit(_result(p, token=first))
    s.finish_commit(pending, [_accept(e.tokens) for e in pending.grammar])
    decode = s.plan()
    assert decode is not None
    return decode


def _accept(tokens: tuple[int, ...], terminated_at: int | None = None) -> GrammarOutcome:
    accepted = len(tokens) if terminated_at is None else terminated_at + 1
    return GrammarOutcome(CommitResult(accepted, terminated_at is not None, None, accepted))


def test_a_run_past_a_stop_token_is_cut_there() -> None:
    """C6 for runs: a decode with three draft positions comes back with four tokens, the second an eos. The output
    keeps the run up to the eos and finishes with STOP; the two after it are never appended or streamed, and the
    watermark covers only the kept tokens' KV. Fails if `_cut` keeps the whole run (checked once)."""
    s = _sched(speculative=_spec(3))
    decode = _decoding(s, "a", max_new=10)
    (entry,) = decode.entries
    assert entry.input_ref and entry.num_draft == 3 and entry.ordinal == 0
    run = SampledRun("a", 1, (7, EOS, 8, 9), num_drafted=3, num_accepted=3)
    out = _commit(s, StepResult(decode.step_id, (run,)))
    (final,) = out.outputs
    assert final.new_token_ids == (7, EOS) and final.output_ids == (5, 7, EOS)
    assert final.finish is not None and final.finish.reason is FinishReason.STOP and final.finish.matched_token == EOS
    assert s.cache is not None and s.cache.num_cached == 1  # prompt 3 + kept KV 2 = 5 positions: one page of 4
    _baseline(s)


def test_above_the_operators_batch_bound_decodes_draft_nothing() -> None:
    """--speculative-disable-by-batch-size 1: a lone decode drafts its full depth; with a second request decoding
    beside it, the step plans no draft for either (and it is no exploring step: the fixed depth here would draft
    every request). Fails if the bound is not applied (checked: both entries carry 3 drafts)."""
    spec = replace(_spec(3), disable_by_batch_size=1)
    (alone,) = _decoding(_sched(speculative=spec), "a", max_new=10).entries
    assert alone.num_draft == 3
    s = _sched(speculative=spec)
    s.add(_req("b", 3, max_new=10))
    decode = _decoding(s, "a", max_new=10)
    assert [(e.request_id, e.num_draft) for e in decode.entries] == [("b", 0), ("a", 0)]


def test_each_decode_steps_batch_and_planned_depth_reach_the_measured_verdict() -> None:
    """The measured verdict (engine/scheduler/batch_verdict.py) keeps what a step costs a request per batch regime: a
    plain step's, and a whole-batch draft's at the full depth. It needs from each committed pure decode step its
    decodes and the depth it was planned at. Six requests decoding under adaptive n-gram speculation, every step
    taking 6 ms, every draft accepted: once a plain step and a whole-batch draft (the rule's first steps alternate the
    two) have committed,
    the six-request regime holds both costs, 1 ms a request, and the next plan tells each decode's output position.
    Fails if the scheduler does not report the step's decodes or its planned depth (checked: no cost measured), or
    each request's output position (checked: all at 0)."""
    s = _sched(speculative=SpeculativeConfig(SpecAlgorithm.NGRAM, num_draft_tokens=4), max_running=8)
    for i in range(6):
        s.add(_req(f"r{i}", 3, max_new=20))
    timing, committed = StepTiming(done=0.006), {f"r{i}": 0 for i in range(6)}
    written: list[tuple[int, int]] = []  # each decode's position as the policy was told it, and as committed
    for _ in range(8):
        plan = s.plan()
        assert plan is not None
        written += [(r.drafting.written, len(r.output_ids)) for r in s._running if r.state is RequestState.DECODING]
        runs = tuple(  # every draft token accepted
            SampledRun(e.request_id, committed[e.request_id], (7,) * (1 + e.num_draft), e.num_draft, e.num_draft)
            for e in plan.entries
            if e.sample
        )
        for run in runs:
            committed[run.request_id] += len(run.token_ids)
        _commit(s, StepResult(plan.step_id, runs, timing))
    here = s._policy._verdict._regimes[regime(6)]
    assert here.plain.value == pytest.approx(0.001) and here.draft.value == pytest.approx(0.001), here
    # Each decode's output position as planned: the verdict weighs a batch's remaining life by it (life_tokens).
    assert written and all(w == n for w, n in written) and any(n for _, n in written), written


def test_drafts_never_let_a_run_outgrow_max_new_tokens() -> None:
    """The draft positions of a decode shrink as the request nears max_new_tokens, so a run fits in what the
    request may take and in its page reservation; a run longer than its entry allows is refused (C2)."""
    s = _sched(speculative=_spec(3))
    decode = _decoding(s, "a", max_new=3)
    (entry,) = decode.entries
    assert entry.num_draft == 1  # one token committed, one sampled: room for one draft
    too_long = SampledRun("a", 1, (7, 8, 9), num_drafted=1, num_accepted=2)
    with pytest.raises(ProtocolError, match="the plan allowed 1 to 2"):
        s.commit(StepResult(decode.step_id, (too_long,)))


def test_a_constrained_run_the_grammar_ends_early_is_cut_at_its_end() -> None:
    """C6 through the grammar: the grammar terminates at the second of three tokens (an eos the request ignores),
    while the stop checks would have ended the run only at its third (the length). The commit of the whole run goes
    to the grammar in one entry from the committed ordinal (C1, C2); the output keeps what the grammar took and
    finishes with STOP. Fails if `_apply_grammar` keeps the run past the grammar's end when the stop checks had
    ended it later (checked once)."""
    s = _sched(speculative=_spec(2))
    req = _req("g", 3, max_new=4, ignore_eos=True)
    req.constraint = REGEX
    s.add(req)
    p = s.plan()
    assert p is not None
    first = s.commit(_result(p, token=5))
    assert [(e.request_id, e.from_ordinal, e.tokens) for e in first.grammar] == [("g", 0, (5,))]
    s.finish_commit(first, [_accept((5,))])
    decode = s.plan()
    assert decode is not None
    pending = s.commit(StepResult(decode.step_id, (SampledRun("g", 1, (6, EOS, 8), num_drafted=2, num_accepted=2),)))
    assert [(e.from_ordinal, e.tokens) for e in pending.grammar] == [(1, (6, EOS, 8))]
    out = s.finish_commit(pending, [_accept((6, EOS, 8), terminated_at=1)])
    (final,) = out.outputs
    assert final.output_ids == (5, 6, EOS) and final.finish is not None and final.finish.reason is FinishReason.STOP
    assert out.released_grammars == ["g"]
    _baseline(s)


def test_a_token_the_grammar_refuses_ends_that_request_alone() -> None:
    """C13 at the commit: in one step the grammar refuses one request's token and takes the other's. The refused
    token is never appended or streamed, its request ends with an abort naming the grammar (cause GRAMMAR) and its
    matcher is released; the other request goes on. Fails if `_apply_grammar` ignores `rejected_token` (the token
    is appended and the request decodes on; checked once)."""
    s = _sched()
    for rid in ("bad", "good"):
        req = _req(rid, 3, max_new=4)
        req.constraint = REGEX
        s.add(req)
    p = s.plan()
    assert p is not None
    pending = s.commit(_result(p, token=9))
    assert [e.request_id for e in pending.grammar] == ["bad", "good"]
    refused = GrammarOutcome(CommitResult(0, False, 9, 0))
    out = s.finish_commit(pending, [refused, _accept((9,))])
    by_id = {o.request_id: o for o in out.outputs}
    bad, good = by_id["bad"], by_id["good"]
    assert bad.new_token_ids == () and bad.output_ids == () and bad.finish is not None
    assert bad.finish.reason is FinishReason.ABORT and bad.finish.cause is AbortCause.GRAMMAR
    assert "refused token 9 at output position 0" in (bad.finish.message or "") and "regex" in (
        bad.finish.message or ""
    )
    assert good.new_token_ids == (9,) and good.finish is None
    assert out.released_grammars == ["bad"]
    nxt = s.plan()
    assert nxt is not None and [e.request_id for e in nxt.entries] == ["good"]


def test_a_grammar_that_refuses_the_commit_itself_ends_the_request() -> None:
    """A commit the grammar service refuses whole (here a stale ordinal) ends the request with a grammar abort."""
    s = _sched()
    req = _req("a", 3)
    req.constraint = REGEX
    s.add(req)
    p = s.plan()
    assert p is not None
    pending = s.commit(_result(p))
    out = s.finish_commit(pending, [GrammarOutcome(None, Refusal.STALE_ORDINAL, "a: commit from 0, at 1")])
    (final,) = out.outputs
    assert final.finish is not None and final.finish.cause is AbortCause.GRAMMAR and final.output_ids == ()
    assert "stale_ordinal" in (final.finish.message or "")


def test_a_row_the_executor_could_not_sample_ends_its_request_alone() -> None:
    """C3/C13: the executor reports a row it could not sample (its fenced mask never came). That request ends with
    a grammar abort carrying the executor's reason and nothing of the row is appended; the step's other request
    commits its token. Fails if `Scheduler.commit` ignores `run.error` (the row's meaningless token is appended;
    checked once)."""
    s = _sched()
    s.add(_req("a", 3))
    s.add(_req("b", 3))
    p = s.plan()
    assert p is not None
    runs = (SampledRun("a", 0, (), error="grammar mask refused (behind_deadline): ..."), SampledRun("b", 0, (4,)))
    out = _commit(s, StepResult(p.step_id, runs))
    by_id = {o.request_id: o for o in out.outputs}
    assert by_id["a"].finish is not None and by_id["a"].finish.cause is AbortCause.GRAMMAR
    assert by_id["a"].output_ids == () and "behind_deadline" in (by_id["a"].finish.message or "")
    assert by_id["b"].new_token_ids == (4,) and by_id["b"].finish is None


def test_a_row_whose_masks_could_not_be_had_from_the_service_ends_unavailable() -> None:
    """The executor could not reach the grammar service for a row's masks (not a refusal of this request's grammar):
    the request ends as when its grammar session is lost, cause GRAMMAR_SERVICE (the client gets UNAVAILABLE and may
    retry), not as a grammar abort. Fails if ``_row_failure`` treats every row error alike (the cause is then
    GRAMMAR and the client gets a finished "abort"; checked once)."""
    s = _sched()
    s.add(_req("a", 3))
    s.add(_req("b", 3))
    p = s.plan()
    assert p is not None
    runs = (
        SampledRun("a", 0, (), error=masks_unavailable("the mask stream broke")),
        SampledRun("b", 0, (), error=mask_refused(Refusal.UNAVAILABLE, "no answer")),
    )
    out = _commit(s, StepResult(p.step_id, runs))
    for o in out.outputs:
        assert o.finish is not None and o.finish.cause is AbortCause.GRAMMAR_SERVICE, o
        assert o.output_ids == ()


def test_the_speculation_cost_model_reads_the_step_period_when_given() -> None:
    """The never-slower rule's cost is what a step costs the engine's throughput: the wall period between commits
    (host work included) when the loop ran the steps back to back, else the executor's time. Here the executor
    reports 1 ms a step while the steps come 10 ms apart: the fitted step cost must be about 10 ms. Fails if
    ``_observe_spec`` ignores ``period_s`` (the fit then says 1 ms, checked once by removing it)."""
    s = _sched(speculative=SpeculativeConfig(SpecAlgorithm.NGRAM, num_steps=4))
    s.add(_req("a", 3, max_new=200))
    _commit(s, _result(s.plan()))  # the prefill
    for _ in range(40):
        plan = s.plan()
        assert plan is not None
        entry = plan.entries[0]
        run = SampledRun(entry.request_id, entry.ordinal + 1, (7,), entry.num_draft, 0)
        s.finish_commit(s.commit(StepResult(plan.step_id, (run,), StepTiming(done=0.001)), period_s=0.010), [])
    fit = s._policy._verify.weights()
    assert fit is not None
    a, b = fit
    assert a + b * 1 == pytest.approx(0.010, rel=0.05)
