"""Page allocator and scheduler: budgets, chunking, drafts trimmed to what may be committed, preemption."""

import pytest

from runtime.sampling.sampling_params import SamplingParams
from runtime.scheduling.pages import PageAllocator
from runtime.scheduling.scheduler import Scheduler, SchedulerLimits
from runtime.scheduling.sequence import Sequence, Status


def seq(rid, prompt_len, arrival, max_tokens=50):
    return Sequence(rid, list(range(1, prompt_len + 1)), SamplingParams(max_tokens=max_tokens), seed=0,
                    arrival=arrival)


def test_allocator_grows_and_releases():
    pages = PageAllocator(4, page_size=4)
    table: list[int] = []
    assert pages.can_grow(table, 16) and not pages.can_grow(table, 17)
    pages.grow(table, 9)
    assert len(table) == 3 and pages.num_free == 1
    pages.grow(table, 12)
    assert len(table) == 3
    pages.release(table)
    assert table == [] and pages.num_free == 4
    with pytest.raises(ValueError):
        PageAllocator(0, 4)


def test_chunked_prefill_then_decode_with_drafts():
    sched = Scheduler(SchedulerLimits(max_num_seqs=4, max_num_batched_tokens=8, max_model_len=64),
                      PageAllocator(32, 4))
    a = seq("a", 12, 0)
    sched.add(a)
    first = sched.schedule()
    assert [(e.start_position, len(e.token_ids), e.sample) for e in first] == [(0, 8, False)]
    a.num_computed = 8
    second = sched.schedule()
    assert [(e.start_position, e.token_ids, e.sample) for e in second] == [(8, [9, 10, 11, 12], True)]
    a.num_computed, a.output_token_ids, a.draft_ids = 12, [40], [41, 42, 43]
    third = sched.schedule()[0]
    assert third.token_ids == [40, 41, 42, 43] and third.num_drafts == 3 and third.start_position == 12
    assert len(third.page_ids) * 4 >= third.end_position


def test_drafts_are_trimmed_to_max_tokens_model_len_and_budget():
    sched = Scheduler(SchedulerLimits(max_num_seqs=4, max_num_batched_tokens=64, max_model_len=64),
                      PageAllocator(32, 4))
    a = seq("a", 4, 0, max_tokens=3)
    sched.add(a)
    sched.schedule()
    a.num_computed, a.output_token_ids, a.draft_ids, a.status = 4, [9], [10, 11, 12], Status.RUNNING
    assert sched.schedule()[0].num_drafts == 1  # 3 - 1 output - 1 for the target's own token
    b = Scheduler(SchedulerLimits(max_num_seqs=4, max_num_batched_tokens=3, max_model_len=64), PageAllocator(32, 4))
    c = seq("c", 2, 0)
    b.add(c)
    b.schedule()
    c.num_computed, c.output_token_ids, c.draft_ids = 2, [5], [6, 7, 8, 9]
    assert b.schedule()[0].num_drafts == 2  # token budget 3 = anchor + 2 drafts


def test_admission_respects_max_num_seqs_and_order():
    sched = Scheduler(SchedulerLimits(max_num_seqs=2, max_num_batched_tokens=100, max_model_len=64),
                      PageAllocator(32, 4))
    for i in range(3):
        sched.add(seq(str(i), 3, i))
    assert [e.request_id for e in sched.schedule()] == ["0", "1"]
    assert [s.request_id for s in sched.waiting] == ["2"]


def test_a_request_is_itself_so_finishing_one_never_removes_a_twin():
    """Two requests alike in every field are two requests: finishing the second leaves the first running (with value
    equality the queue's ``remove`` took the first equal one, and every ``in`` compared all fields)."""
    sched = Scheduler(SchedulerLimits(max_num_seqs=4, max_num_batched_tokens=100, max_model_len=64),
                      PageAllocator(32, 4))
    first, twin = seq("same", 3, 0), seq("same", 3, 0)
    assert first != twin
    sched.add(first)
    sched.add(twin)
    sched.schedule()
    sched.finish(twin, "stop")
    assert sched.running == [first] and sched.running[0] is first and twin.status is Status.FINISHED


def test_preemption_releases_the_newest_and_requeues_it_first():
    pages = PageAllocator(4, 4)
    sched = Scheduler(SchedulerLimits(max_num_seqs=4, max_num_batched_tokens=100, max_model_len=64), pages)
    old, new = seq("old", 7, 0), seq("new", 7, 1)
    sched.add(old)
    sched.add(new)
    sched.schedule()
    for s in (old, new):
        s.num_computed, s.output_token_ids, s.draft_ids = 7, [1], [2, 3, 4]
    entries = sched.schedule()  # old needs a third page: none free -> new is preempted
    assert [e.request_id for e in entries] == ["old"]
    assert new.status is Status.WAITING and new.num_computed == 0 and new.draft_ids == []
    assert sched.waiting[0] is new and sched.take_released() == (["new"], []) and sched.num_preemptions == 1


def test_lookahead_allots_the_next_tokens_page_when_one_is_free_and_never_preempts_for_it():
    sched = Scheduler(SchedulerLimits(max_num_seqs=4, max_num_batched_tokens=64, max_model_len=64),
                      PageAllocator(3, 4))
    sched.lookahead = 1
    a = seq("a", 7, 0)
    sched.add(a)
    entry = sched.schedule()[0]  # prefill of 7 tokens (2 pages); its first decode writes position 7: same page
    assert len(entry.page_ids) == 2
    a.num_computed, a.output_token_ids = 7, [40]
    entry = sched.schedule()[0]  # decode at position 7 fills page 2; position 8 (next step) needs page 3
    assert len(entry.page_ids) == 3 and sched.pages.num_free == 0
    b = seq("b", 1, 1)
    sched.add(b)
    a.num_computed, a.output_token_ids = 8, [40, 41]
    assert [e.request_id for e in sched.schedule()] == ["a"]  # b waits: no page; a keeps its lookahead page
    assert a.status is Status.RUNNING and sched.num_preemptions == 0
    tight = Scheduler(SchedulerLimits(max_num_seqs=4, max_num_batched_tokens=64, max_model_len=64),
                      PageAllocator(2, 4))
    tight.lookahead = 1
    c = seq("c", 7, 0)
    tight.add(c)
    tight.schedule()
    c.num_computed, c.output_token_ids = 7, [40]
    entry = tight.schedule()[0]  # position 7 fits its 2 pages; the lookahead page does not exist: no preemption
    assert entry.request_id == "c" and len(entry.page_ids) == 2 and tight.num_preemptions == 0
