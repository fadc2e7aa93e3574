"""Scheduler bookkeeping driven directly: plans are inspected and results are written by hand.

The model is not what these tests are about, so step results are made up (token ids chosen by the test);
everything else (allocator, slots, prefix cache, stop checks, lifecycle) is the real code.
"""

from __future__ import annotations

import pytest

from engine.config import EngineConfig
from engine.errors import ProtocolError
from engine.request import IllegalTransitionError, Request, RequestState
from engine.sampling_params import SamplingParams
from engine.scheduler import Scheduler
from engine.step import SampledToken, StepPlan, StepResult
from engine.stop import AbortCause, FinishReason, StopChecker

EOS = 2


def _req(rid: str, n_prompt: int, max_new: int = 4, **kw: object) -> Request:
    params = SamplingParams(temperature=0.0, max_new_tokens=max_new, **kw)  # type: ignore[arg-type]
    prompt = tuple(range(10, 10 + n_prompt))
    return Request(rid, prompt, params, StopChecker(params, frozenset({EOS}), None), seed=0)


def _result(plan: StepPlan, token: int = 7) -> StepResult:
    samples = tuple(SampledToken(e.request_id, e.ordinal, token) for e in plan.entries if e.sample)
    return StepResult(plan.step_id, samples)


def _sched(**kw: object) -> Scheduler:
    base = {"page_size": 4, "num_pages": 64, "max_running": 8, "chunk_size": 16}
    base.update(kw)
    return Scheduler(EngineConfig(**base))  # type: ignore[arg-type]


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
    s.commit(_result(p1))
    p2 = s.plan()
    assert p2 is not None and p2.entries[0].start_pos == 5 and not p2.entries[0].sample
    s.commit(_result(p2))
    p3 = s.plan()
    assert p3 is not None and p3.entries[0].start_pos == 10 and p3.entries[0].sample


def test_overlap_decode_refers_to_the_token_in_flight() -> None:
    s = _sched()
    s.add(_req("a", 3, max_new=3))
    p1 = s.plan()
    assert p1 is not None
    p2 = s.plan()  # planned while p1 is in flight
    assert p2 is not None
    e = p2.entries[0]
    assert e.input_ref and e.ordinal == 1 and e.start_pos == 3
    out = s.commit(_result(p1, token=40))
    assert [o.new_token_ids for o in out.outputs] == [(40,)]
    p3 = s.plan()
    assert p3 is not None and p3.entries[0].ordinal == 2
    s.commit(_result(p2, token=41))
    assert s.plan() is None  # max_new_tokens reached by what is in flight
    out = s.commit(_result(p3, token=42))
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
    out = s.commit(_result(p1, token=EOS))
    assert out.outputs[0].finish is not None and out.outputs[0].finish.reason is FinishReason.STOP
    assert out.released_slots == []  # C9: p2 still names the request
    assert s.stats().free_slots == 7
    out = s.commit(_result(p2, token=99))
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
    out = s.commit(_result(p1))
    assert out.outputs == [] and out.released_slots == [0]
    assert s.abort("a").outputs == []  # twice: no-op
    _baseline(s)


def test_commit_out_of_order_or_wrong_ordinal_is_refused() -> None:
    """C1, C2. Fails if the step-order check at the top of `Scheduler.commit` is removed (p2 commits before p1)
    or if `_pair` stops comparing the sample's ordinal with the entry's: checked once each."""
    s = _sched()
    s.add(_req("a", 3))
    p1 = s.plan()
    p2 = s.plan()
    assert p1 is not None and p2 is not None
    with pytest.raises(ProtocolError, match="out of order"):
        s.commit(_result(p2))
    bad = StepResult(p1.step_id, (SampledToken("a", 5, 1),))
    with pytest.raises(ProtocolError, match="does not match the plan"):
        s.commit(bad)


def test_reservation_blocks_admission_until_pages_return() -> None:
    s = _sched(num_pages=6, prefix_cache=False)
    s.add(_req("a", 8, max_new=9))  # needs ceil(16 / 4) = 4 pages
    s.add(_req("b", 8, max_new=9))
    p = s.plan()
    assert p is not None and [e.request_id for e in p.entries] == ["a"]  # b would need 4 of the 2 left
    while p is not None:
        s.commit(_result(p))
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
    s.commit(_result(p))
    assert s.cache is not None and s.cache.num_cached == 1
    assert s.cache.match((*range(10, 17), 7)).num_tokens == 4
    _baseline(s)


def test_executor_lost_aborts_everything_and_drops_the_cache() -> None:
    s = _sched()
    s.add(_req("done", 9, max_new=1))
    p = s.plan()
    assert p is not None
    s.commit(_result(p))
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
    s.commit(_result(p))
    assert s.abort("queued").outputs and s.stats().num_running == 0
