"""The Pool's result objects, completed in runs, and imap's window, without processes."""

from __future__ import annotations

import collections
import pickle
import threading
from types import SimpleNamespace

import pytest

from jaxtransport import _wire
from jaxtransport.pool._engine import IMAP_WIDE, IMAP_WIDER, Engine
from jaxtransport.pool._results import IMapIterator, MapResult
from jaxtransport.pool._scheduler import Chunk, Scheduler


def test_a_map_result_filled_in_runs_in_any_order():
    r = MapResult(None, 7, 2)  # chunks [0, 1] [2, 3] [4, 5] [6]
    r.chunks_done([(3, True, [6]), (0, True, [0, 1])])
    assert not r.ready()
    r.chunks_done([(2, True, [4, 5])])
    r.chunks_done([(1, True, [2, 3])])
    assert r.ready() and r.get() == list(range(7))


def test_the_first_failing_chunk_of_a_run_fails_the_map_and_the_rest_is_ignored():
    r = MapResult(None, 4, 1)
    r.chunks_done([(0, True, [0]), (1, False, ValueError("one")), (2, True, [2])])
    assert r.ready() and not r.successful()
    with pytest.raises(ValueError, match="one"):
        r.get()
    r.chunks_done([(3, False, KeyError("late"))])  # already failed: the first error stays
    with pytest.raises(ValueError, match="one"):
        r.get()


def test_an_ordered_imap_yields_in_order_whatever_the_runs_and_raises_in_place():
    it = IMapIterator(None, ordered=True)
    consumer: list = []

    def consume():
        try:
            for v in it:
                consumer.append(v)
        except KeyError as e:
            consumer.append(e)

    t = threading.Thread(target=consume)
    t.start()
    it.chunks_done([(2, True, [20, 21]), (1, True, [10])])
    it.chunks_done([(0, True, [0, 1]), (3, False, KeyError("three")), (4, True, [40])])
    it.set_length(5)
    t.join(10)
    assert consumer[:5] == [0, 1, 10, 20, 21]
    assert isinstance(consumer[5], KeyError) and len(consumer) == 6
    assert it.unconsumed() == 1  # chunk 4 finished, not consumed


def test_an_unordered_imap_yields_in_completion_order():
    it = IMapIterator(None, ordered=False)
    it.chunks_done([(1, True, [10, 11]), (0, True, [])])
    it.chunk_done(2, True, [20])
    it.set_length(3)
    assert list(it) == [10, 11, 20]


def test_finished_many_takes_a_run_of_results_off_a_workers_books():
    w = SimpleNamespace(outstanding=collections.deque())
    enc = SimpleNamespace(handles=[], trees=[], data=b"x")
    chunks = [Chunk(i, None, i, enc) for i in range(4)]
    w.outstanding.extend(chunks)
    got = Scheduler.finished_many(w, [0, 2, 1, 9])
    assert got == [chunks[0], chunks[2], chunks[1], None]
    assert list(w.outstanding) == [chunks[3]]


@pytest.mark.parametrize("processes", [2, 8])
def test_imaps_window_widens_only_while_nothing_goes_through_shared_memory(processes):
    engine = SimpleNamespace(processes=processes)
    base = 2 * processes + 2
    assert Engine.imap_window(engine, 0, True) == base  # nothing known yet
    assert Engine.imap_window(engine, base, False) == base * IMAP_WIDE  # light results
    assert Engine.imap_window(engine, base, True) == base * IMAP_WIDER  # and light arguments
    assert Engine.imap_window(engine, -1, True) == base  # a result used shared memory


class Refuses:
    def __reduce__(self):
        return (_refuse, ())


def _refuse():
    raise RuntimeError("no")


def test_loads_each_keeps_each_failure_to_its_own_message():
    out = _wire.loads_each([pickle.dumps([1]), pickle.dumps(Refuses()), b"garbage", pickle.dumps("x")], "host")
    assert out[0] == (True, [1]) and out[3] == (True, "x")
    assert out[1][0] is False and isinstance(out[1][1], RuntimeError)
    assert out[2][0] is False and isinstance(out[2][1], Exception)
    tb = out[1][1].__traceback__
    while tb is not None:  # its traceback does not hold loads_each's frame (and so ``out``)
        assert tb.tb_frame.f_code is not _wire.loads_each.__code__
        tb = tb.tb_next
