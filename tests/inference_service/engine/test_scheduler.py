"""The step planner alone: exact admissions and plans, no model (as vLLM tests its scheduler)."""
from __future__ import annotations

from inference_service.engine.scheduler import Scheduler, SchedulerLimits, RequestState, StepPlan
from inference_service.kv_memory.slot_ledger import SlotLedger

BYTES_PER_TOKEN = 10


def make_scheduler(num_slots: int = 4, budget_tokens: int = 10_000, **limits) -> Scheduler:
    return Scheduler(SchedulerLimits(**limits), SlotLedger(num_slots, budget_tokens * BYTES_PER_TOKEN, BYTES_PER_TOKEN))


def make_state(seq_id: int, prompt: int, new: int = 10, rows: int = 1) -> RequestState:
    return RequestState(seq_id, prompt, prompt + new, num_rows=rows)


def looked_up(scheduler: Scheduler, cached: dict[int, int], whole: frozenset[int] = frozenset()) -> None:
    """What the executor does after admission: says how much of each prompt is already in place."""
    for state in scheduler.prefilling:
        if state.num_computed is None:
            state.num_computed, state.whole = cached.get(state.seq_id, 0), state.seq_id in whole


def test_admission_is_first_come_and_reserves_slots_lowest_first():
    scheduler = make_scheduler(num_slots=3)
    for seq_id in (1, 2, 3, 4):
        scheduler.add(make_state(seq_id, 20))
    # Three slots: the first three are admitted in arrival order; the fourth waits.
    assert [(state.seq_id, state.slots) for state in scheduler.admit()] == [(1, [0]), (2, [1]), (3, [2])]
    assert [state.seq_id for state in scheduler.waiting] == [4]
    assert scheduler.ledger.bytes_in_use == 3 * 30 * BYTES_PER_TOKEN


def test_a_request_that_does_not_fit_the_budget_blocks_the_ones_behind_it():
    scheduler = make_scheduler(num_slots=4, budget_tokens=100)
    scheduler.add(make_state(1, 50))  # reserves 60 of 100 tokens
    scheduler.add(make_state(2, 50))  # needs 60: waits
    scheduler.add(make_state(3, 5))  # would fit (15), but must not overtake 2, or 2 could starve
    assert [state.seq_id for state in scheduler.admit()] == [1]
    assert [state.seq_id for state in scheduler.waiting] == [2, 3]
    # 1 ends: its slot and bytes come back, and 2 and 3 are admitted in order, 2 taking slot 0 again.
    scheduler.remove(1)
    scheduler.ledger.release(0)
    assert [(state.seq_id, state.slots) for state in scheduler.admit()] == [(2, [0]), (3, [1])]


def test_max_running_requests_counts_requests_not_their_rows():
    scheduler = make_scheduler(num_slots=24, max_running_requests=4)
    scheduler.add(make_state(1, 20, rows=16))  # 16 completions of one request
    for seq_id in (2, 3, 4, 5):
        scheduler.add(make_state(seq_id, 20))
    # Beside the 16 rows, three single-row requests still start: four requests run; the fifth waits for a place.
    assert [(state.seq_id, len(state.slots)) for state in scheduler.admit()] == [(1, 16), (2, 1), (3, 1), (4, 1)]
    assert [state.seq_id for state in scheduler.waiting] == [5]
    looked_up(scheduler, {})
    for state in list(scheduler.prefilling):
        scheduler.prefilled(state.seq_id)
    scheduler.remove(2)  # a short request ends: its place goes to the next one at once
    assert [state.seq_id for state in scheduler.admit()] == [5]


def test_n_completions_reserve_n_slots_and_n_times_the_bytes():
    scheduler = make_scheduler(num_slots=4, budget_tokens=1000)
    scheduler.add(make_state(1, 40, new=10, rows=3))
    (state,) = scheduler.admit()
    assert state.slots == [0, 1, 2]
    assert scheduler.ledger.bytes_in_use == 3 * 50 * BYTES_PER_TOKEN


def test_a_lone_prefill_runs_to_its_end_in_one_piece():
    scheduler = make_scheduler(max_prefill_tokens=512)
    scheduler.add(make_state(1, 1600))
    scheduler.admit()
    looked_up(scheduler, {1: 0})
    # Nobody decodes or waits: nothing is gained by cutting it.
    assert scheduler.plan() == StepPlan(pieces=((1, 1600),))


def test_a_long_prefill_runs_in_budgeted_pieces_while_others_decode():
    scheduler = make_scheduler(max_prefill_tokens=512)
    scheduler.add(make_state(1, 30))
    scheduler.admit()
    looked_up(scheduler, {1: 0})
    assert scheduler.plan() == StepPlan(groups=((1,),))  # short: runs whole in a forward
    scheduler.prefilled(1)
    scheduler.add(make_state(2, 1600))
    scheduler.admit()
    looked_up(scheduler, {2: 100})  # 100 tokens came from the store
    plans = []
    for _ in range(3):
        plan = scheduler.plan()
        plans.append(plan)
        for _, num_tokens in plan.pieces:  # the executor runs the piece
            scheduler.prefilling[0].num_computed += num_tokens
    # 1500 tokens left in pieces of 512 while row 1 decodes in every step.
    assert plans == [StepPlan(pieces=((2, 512),), decode=(1,)), StepPlan(pieces=((2, 512),), decode=(1,)),
                     StepPlan(pieces=((2, 476),), decode=(1,))]


def test_short_prefills_go_first_in_shared_forwards_and_the_oldest_long_one_still_moves():
    scheduler = make_scheduler(num_slots=8, budget_tokens=100_000, max_prefill_tokens=256, max_forward_tokens=64)
    scheduler.add(make_state(9, 8))
    scheduler.admit()
    looked_up(scheduler, {9: 0})
    scheduler.plan()
    scheduler.prefilled(9)  # one row decoding
    scheduler.add(make_state(1, 3000))  # a long document, oldest
    for seq_id, prompt in ((2, 40), (3, 30), (4, 50), (5, 20)):  # short questions behind it
        scheduler.add(make_state(seq_id, prompt))
    scheduler.admit()
    looked_up(scheduler, {1: 0})
    # Shorts first, in forwards of at most 64 tokens: [2] (40), [3] (30), [4] (50): 120 of 256... then 5 (20) joins 4's?
    # No: 4 + 5 = 70 > 64, so 5 starts a forward of its own. The long one gets what is left: 256 - 140 = 116.
    assert scheduler.plan() == StepPlan(pieces=((1, 116),), groups=((2,), (3,), (4,), (5,)), decode=(9,))


def test_the_oldest_long_prefill_gets_a_forward_even_when_short_ones_take_the_budget():
    scheduler = make_scheduler(num_slots=8, budget_tokens=100_000, max_prefill_tokens=64, max_forward_tokens=64)
    scheduler.add(make_state(9, 8))
    scheduler.admit()
    looked_up(scheduler, {9: 0})
    scheduler.plan()
    scheduler.prefilled(9)
    scheduler.add(make_state(1, 3000))
    scheduler.add(make_state(2, 64))
    scheduler.add(make_state(3, 900))
    scheduler.admit()
    looked_up(scheduler, {})
    # The short question takes the whole budget; the oldest long prefill still moves by max_forward_tokens
    # (never starved); the younger long one waits.
    assert scheduler.plan() == StepPlan(pieces=((1, 64),), groups=((2,),), decode=(9,))


def test_a_whole_prefill_runs_all_its_rest_in_one_piece():
    scheduler = make_scheduler(max_prefill_tokens=64)
    scheduler.add(make_state(9, 8))
    scheduler.admit()
    looked_up(scheduler, {9: 0})
    scheduler.plan()
    scheduler.prefilled(9)
    scheduler.add(make_state(1, 300))
    scheduler.admit()
    looked_up(scheduler, {1: 40}, whole=frozenset({1}))  # content hits to repair: one pass over the prompt
    assert scheduler.plan() == StepPlan(pieces=((1, 260),), decode=(9,))


def test_without_batched_prefills_every_short_one_runs_alone():
    scheduler = make_scheduler(batch_prefills=False, max_forward_tokens=128)
    for seq_id in (1, 2):
        scheduler.add(make_state(seq_id, 10))
    scheduler.admit()
    looked_up(scheduler, {})
    assert scheduler.plan() == StepPlan(groups=((1,), (2,)))


def test_a_sequence_not_looked_up_yet_is_not_planned_and_removal_forgets_it_everywhere():
    scheduler = make_scheduler()
    scheduler.add(make_state(1, 10))
    scheduler.add(make_state(2, 10))
    scheduler.admit()
    scheduler.prefilling[0].num_computed = 0  # 2 waits for its batch's source, say
    assert scheduler.plan() == StepPlan(groups=((1,),))
    assert scheduler.remove(2).seq_id == 2 and scheduler.remove(2) is None
    scheduler.prefilled(1)
    assert scheduler.remove(1).seq_id == 1 and not scheduler.has_work()


def test_step_sizes_come_from_the_device_unless_given():
    from inference_service.engine.scheduler import DEVICE_LIMITS, device_limits

    assert device_limits("cpu") == (512, 128)
    assert device_limits("cuda") == DEVICE_LIMITS["cuda"] and DEVICE_LIMITS["cuda"][0] > 512
    assert device_limits("cuda", 300, 50) == (300, 50)
    assert device_limits("mps") == (512, 128), "an unknown device gets the CPU's"
