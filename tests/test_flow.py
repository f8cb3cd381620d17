"""The stage runner on toy stages: the same results inline and in threads, bounded queues, errors, cancel."""

import threading
import time

import pytest

from heygem.errors import GenerationCancelled, HeygemError
from heygem.runtime.flow import Stage, StageClock, ordered_map, run_stages


def collect(into: list):
    def sink(items):
        for item in items:
            into.append(item)
            yield item
    return Stage("sink", sink)


def double(items):
    for item in items:
        yield item * 2


def add_running_total(items):
    total = 0
    for item in items:
        total += item
        yield (item, total)


@pytest.mark.parametrize("concurrent", [False, True])
def test_stages_give_the_same_items_in_order(concurrent):
    results = []
    count = run_stages(range(200), [Stage("double", double), Stage("total", add_running_total), collect(results)],
                       concurrent=concurrent)
    assert count == 200
    assert results == [(2 * i, i * (i + 1)) for i in range(200)]


def slow(name: str) -> Stage:
    """A stage that takes 20 ms an item."""
    def run(items):
        for item in items:
            time.sleep(0.02)
            yield item
    return Stage(name, run)


def test_concurrent_stages_overlap_and_the_clock_counts_busy_time():
    clock = StageClock()
    started = time.perf_counter()
    run_stages(range(20), [slow("a"), slow("b"), slow("c")], concurrent=True, clock=clock)
    elapsed = time.perf_counter() - started
    assert elapsed < 0.75 * 3 * 20 * 0.02  # inline would take 1.2 s; three stages at once about 0.45
    for name in "abc":
        assert 0.35 < clock.seconds[name] < 0.7, clock.seconds  # its own sleeping, not its neighbours'


def test_inline_clock_takes_the_earlier_stages_out():
    def slow(seconds):
        def run(items):
            for item in items:
                time.sleep(seconds)
                yield item
        return run

    clock = StageClock()
    run_stages(range(10), [Stage("quick", slow(0.001)), Stage("slow", slow(0.02))], concurrent=False, clock=clock)
    assert clock.seconds["quick"] < 0.08 and 0.18 < clock.seconds["slow"] < 0.4, clock.seconds


@pytest.mark.parametrize("concurrent", [False, True])
def test_the_clock_tells_computing_from_waiting(concurrent):
    def waiting(items):
        for item in items:
            time.sleep(0.03)
            yield item

    def computing(items):
        for item in items:
            until = time.thread_time() + 0.03
            while time.thread_time() < until:
                pass
            yield item

    clock = StageClock()
    run_stages(range(8), [Stage("waits", waiting), Stage("computes", computing)], concurrent=concurrent,
               clock=clock)
    assert clock.seconds["waits"] > 0.2 and clock.cpu_seconds["waits"] < 0.1, clock.cpu_seconds
    # the computing stage's CPU time is its own, without the sleeping stage before it
    assert 0.24 <= clock.cpu_seconds["computes"] < 0.35 and clock.seconds["computes"] >= 0.24, clock.cpu_seconds


@pytest.mark.parametrize("depth, most", [(2, 4), (None, 3)])
def test_queues_bound_how_far_the_source_runs_ahead(depth, most):
    """The default is one item queued per boundary: a 1080p batch is tens of MiB."""
    produced = []
    gate = threading.Event()

    def source():
        for index in range(1000):
            produced.append(index)
            yield index

    def blocked(items):
        for item in items:
            gate.wait()
            yield item

    runner = threading.Thread(target=run_stages, args=(source(), [Stage("blocked", blocked)]),
                              kwargs={"concurrent": True, **({"depth": depth} if depth else {})})
    runner.start()
    time.sleep(0.5)
    ahead = len(produced)
    gate.set()
    runner.join(10)
    # one in the stage, `depth` queued, one waiting to be queued
    assert ahead == most, ahead
    assert len(produced) == 1000


@pytest.mark.parametrize("concurrent", [False, True])
def test_an_error_stops_every_stage_names_the_stage_and_runs_clean_up(concurrent):
    cleaned = []

    def source():
        try:
            for index in range(10_000):  # noqa: UP028 - one item at a time, so the finally below runs on close
                yield index
        finally:
            cleaned.append("source")

    def failing(items):
        try:
            for item in items:
                if item == 30:
                    raise HeygemError("frame 30 is broken")
                yield item
        finally:
            cleaned.append("failing")

    def after(items):
        try:
            yield from items
        finally:
            cleaned.append("after")

    with pytest.raises(HeygemError, match="frame 30 is broken") as raised:
        run_stages(source(), [Stage("failing", failing), Stage("after", after)], concurrent=concurrent)
    if concurrent:
        assert any("failing stage" in note for note in raised.value.__notes__)
    assert sorted(cleaned) == ["after", "failing", "source"]
    stage_threads = {"heygem-decode", "heygem-failing", "heygem-after"}
    assert not [thread for thread in threading.enumerate() if thread.name in stage_threads]


@pytest.mark.parametrize("concurrent", [False, True])
def test_should_stop_cancels_the_run(concurrent):
    seen = []

    def sink(items):
        for item in items:
            seen.append(item)
            yield item

    with pytest.raises(GenerationCancelled):
        run_stages(range(100_000), [Stage("sink", sink)], concurrent=concurrent,
                   should_stop=lambda: len(seen) >= 50)
    assert 50 <= len(seen) < 1000


def test_ordered_map_keeps_order_on_several_threads_and_raises_in_place():
    def slow_square(value):
        time.sleep(0.001 * (value % 5))
        return value * value

    assert list(ordered_map(slow_square, range(100), workers=4)) == [v * v for v in range(100)]
    assert list(ordered_map(slow_square, range(10), workers=1)) == [v * v for v in range(10)]

    def fails_at_7(value):
        if value == 7:
            raise ValueError("seven")
        return value

    results = []
    with pytest.raises(ValueError, match="seven"):
        for value in ordered_map(fails_at_7, range(20), workers=3):
            results.append(value)
    assert results == list(range(7))


def test_the_clock_keeps_when_each_stage_ran_so_overlapping_stages_can_be_drawn_on_a_time_line():
    clock = StageClock()
    run_stages(range(10), [slow("a"), slow("b")], concurrent=True, clock=clock)
    loaded = time.perf_counter()
    time.sleep(0.05)
    clock.add("load", 0.2, started=loaded - 0.2)  # timed in the background, added later
    (a_start, a_end), (b_start, b_end) = clock.spans["a"], clock.spans["b"]
    assert 0 <= a_start < b_start < a_end < b_end  # b starts on a's first item, long before a's last
    assert a_end - a_start >= clock.seconds["a"] - 0.01 and b_end - b_start >= clock.seconds["b"] - 0.01
    load_start, load_end = clock.spans["load"]
    assert load_end - load_start == pytest.approx(0.2) and load_end == pytest.approx(loaded - clock.origin)
