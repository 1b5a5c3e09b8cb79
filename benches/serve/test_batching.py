"""CPU tests of the serving loop's page accounting and scheduler (pure Python, no torch):
admission under the block budget, FCFS, eviction on finish, the budget never exceeded.

    python -m pytest -q benches/serve/
"""

import random
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

from batching import PagePool, Request, Scheduler, max_batch_for, mixed_requests  # noqa: E402


# ------------------------------------------------------------------ pool and scheduler


def test_pool_alloc_free_and_double_free():
    p = PagePool(10, 16)
    a = p.alloc(4)
    assert a == [0, 1, 2, 3] and p.free_blocks == 6
    assert p.alloc(7) is None and p.free_blocks == 6  # all or nothing
    b = p.alloc(6)
    assert sorted(a + b) == list(range(10)) and p.free_blocks == 0
    p.free(a)
    assert p.free_blocks == 4 and p.peak == 10
    with pytest.raises(ValueError):
        p.free([0])
    assert p.blocks_for(33) == 3 and p.blocks_for(32) == 2


def test_contiguous_pool_first_fit_and_fragmentation():
    p = PagePool(8, 4, contiguous=True)
    a, b, c = p.alloc(3), p.alloc(2), p.alloc(3)
    assert (a, b, c) == ([0, 1, 2], [3, 4], [5, 6, 7])
    p.free(a)
    p.free(c)
    assert p.free_blocks == 6
    assert p.alloc(4) is None  # 6 free blocks, but no run of 4
    assert p.alloc(3) == [0, 1, 2]


def test_scheduler_admits_fcfs_within_budget_and_frees_on_finish():
    pool = PagePool(10, 16)
    s = Scheduler(pool, max_batch=8)
    reqs = [Request(rid=i, prompt_len=40, max_new=8) for i in range(4)]  # 48 tokens = 3 blocks each
    for r in reqs:
        s.add(r)
    new = s.admit()
    assert [r.rid for r in new] == [0, 1, 2] and pool.used == 9  # the 4th waits: 1 block left
    assert s.admit() == []
    for r in new[:1]:
        r.generated = [0] * r.max_new
    done = s.retire()
    assert [r.rid for r in done] == [0] and pool.used == 6
    assert [r.rid for r in s.admit()] == [3] and pool.used == 9


def test_scheduler_batch_cap_arrivals_and_rejection():
    pool = PagePool(100, 16)
    s = Scheduler(pool, max_batch=2)
    s.add(Request(rid=0, prompt_len=10, max_new=1))
    s.add(Request(rid=1, prompt_len=10, max_new=1, arrival=2))
    s.add(Request(rid=2, prompt_len=10, max_new=1, arrival=2))
    s.add(Request(rid=3, prompt_len=16 * 100, max_new=1))  # can never fit
    assert [r.rid for r in s.rejected] == [3]
    assert [r.rid for r in s.admit()] == [0]
    s.tick()
    assert s.admit() == []  # not arrived yet
    s.tick()
    assert [r.rid for r in s.admit()] == [1]  # batch cap 2
    assert len(s.running) == 2 and len(s.waiting) == 1


def test_scheduler_prefill_token_cap():
    pool = PagePool(100, 16)
    s = Scheduler(pool, max_batch=10, max_prefill_tokens=100)
    for i in range(3):
        s.add(Request(rid=i, prompt_len=60, max_new=1))
    assert [r.rid for r in s.admit()] == [0]  # the second would exceed 100 prompt tokens
    assert [r.rid for r in s.admit()] == [1]


@pytest.mark.parametrize("contiguous", [False, True])
def test_simulated_serving_never_exceeds_budget(contiguous):
    rng = random.Random(1)
    pool = PagePool(40, 16, contiguous=contiguous)
    s = Scheduler(pool, max_batch=6, max_prefill_tokens=300)
    reqs = mixed_requests(50, [17, 64, 100, 200], max_new=9, seed=3, arrivals_per_step=0.7)
    for r in reqs:
        s.add(r)
    steps = 0
    while not s.idle:
        new = s.admit()
        for r in new:
            r.generated.append(0)
        for r in s.running:
            if r not in new and not r.done:
                r.generated.append(rng.randrange(5))
            assert r.length <= len(r.blocks) * pool.block_tokens  # its cache fits its blocks
        assert 0 <= pool.used <= pool.num_blocks
        assert pool.used == sum(len(r.blocks) for r in s.running)
        assert len(s.running) <= 6
        s.retire()
        s.tick()
        steps += 1
        assert steps < 10_000
    assert pool.used == 0 and len(s.finished) == 50
    assert all(len(r.generated) == 9 for r in s.finished)
    assert [r.rid for r in sorted(s.finished, key=lambda r: r.admitted_step)] == sorted(r.rid for r in s.finished)  # FCFS


def test_fcfs_head_of_line_waits_for_blocks_and_is_admitted_first():
    """A request at the head that does not fit keeps the smaller ones behind it waiting (no
    overtaking), and is admitted first once finished requests return their blocks."""
    pool = PagePool(6, 16)
    s = Scheduler(pool, max_batch=8)
    s.add(Request(rid=0, prompt_len=60, max_new=4))  # 4 blocks
    s.add(Request(rid=1, prompt_len=60, max_new=4))  # 4 blocks: waits
    s.add(Request(rid=2, prompt_len=10, max_new=2))  # 1 block: would fit, but is behind rid 1
    assert [r.rid for r in s.admit()] == [0] and pool.used == 4
    assert s.admit() == [] and [r.rid for r in s.waiting] == [1, 2]
    s.running[0].generated = [0] * 4
    assert [r.rid for r in s.retire()] == [0] and pool.used == 0
    assert [r.rid for r in s.admit()] == [1, 2] and pool.used == 5


def test_retire_frees_only_finished_requests_once():
    pool = PagePool(20, 16)
    s = Scheduler(pool, max_batch=8)
    for i in range(3):
        s.add(Request(rid=i, prompt_len=20, max_new=3))  # 2 blocks each
    reqs = s.admit()
    reqs[1].generated = [0, 0, 0]
    reqs[2].generated = [0, 0]  # not done: keeps its blocks
    assert [r.rid for r in s.retire()] == [1] and pool.used == 4
    assert s.retire() == [] and pool.used == 4  # nothing freed twice
    assert sorted(b for r in s.running for b in r.blocks) == sorted(set(b for r in s.running for b in r.blocks))
    assert [r.rid for r in s.finished] == [1] and reqs[1].finished_step == 0


def test_reserved_blocks_cover_every_token_a_request_will_hold():
    """Admission reserves prompt + token budget up front, so a running request never needs a
    block it does not hold (nothing is preempted) and the pool never over-commits."""
    pool = PagePool(50, 8)
    s = Scheduler(pool, max_batch=50)
    for i, (n, new) in enumerate([(1, 1), (7, 1), (8, 1), (9, 8), (15, 2), (16, 17)]):
        s.add(Request(rid=i, prompt_len=n, max_new=new))
    for r in s.admit():
        assert len(r.blocks) == -(-(r.prompt_len + r.max_new) // 8)
        assert len(r.blocks) * 8 >= r.prompt_len + r.max_new - 1  # the last token is never written back
    assert s.reserved_tokens() == pool.used * 8 <= pool.num_blocks * 8


def test_max_batch_for():
    assert max_batch_for(100, 16, 33) == 33  # 3 blocks each
    assert max_batch_for(100, 64, 64 * 10 + 1) == 9
