"""Time limits in the solving thread's CPU seconds (bonsai_core.solvers.deadline.cpu_seconds)."""

import threading
import time

from bonsai_core.solvers.deadline import Deadline, backend_seconds, counts_cpu, cpu_seconds


def _sleep_then_spin(sleep: float, spin: float) -> None:
    time.sleep(sleep)  # wall time that is not this thread's CPU time, as a loaded machine's wait is
    begun = time.thread_time()
    while time.thread_time() - begun < spin:
        pass


def test_a_deadline_in_cpu_seconds_does_not_count_the_time_the_thread_waits():
    with cpu_seconds():
        clock = Deadline(0.5)
        _sleep_then_spin(0.6, 0.05)
        assert counts_cpu() and not clock.passed()  # 0.65 s of wall time, 0.05 s of CPU
        _sleep_then_spin(0.0, 0.5)
        assert clock.passed()
    assert not counts_cpu()
    clock = Deadline(0.5)  # outside the block: wall-clock seconds
    time.sleep(0.6)
    assert clock.passed()


def test_a_backend_is_given_the_wall_seconds_the_cpu_seconds_take_at_the_threads_pace():
    assert backend_seconds(3.0) == 3.0 and backend_seconds(None) is None  # wall-clock deadlines: unchanged
    with cpu_seconds():
        assert backend_seconds(3.0) >= 3.0  # no pace of its own yet: the last block's, at least 1
        _sleep_then_spin(1.0, 0.5)  # at least 3 wall seconds per CPU second (more on a loaded machine)
        assert backend_seconds(3.0) >= 2.5 * 3.0


def test_a_blocks_first_backend_call_is_given_the_last_blocks_pace():
    with cpu_seconds():
        _sleep_then_spin(1.0, 0.5)  # a loaded machine: at least 3 wall seconds per CPU second
    with cpu_seconds():  # the next solve: its first backend call comes before it has a pace of its own
        assert backend_seconds(3.0) >= 2.5 * 3.0
    with cpu_seconds():
        _sleep_then_spin(3.0, 0.5)  # slower still: at least 7 wall seconds per CPU second
    with cpu_seconds():
        assert backend_seconds(3.0) >= 6.5 * 3.0  # the latest block's pace, not the first one's


def test_the_cpu_clock_is_the_threads_own():
    seen = []
    with cpu_seconds():
        other = threading.Thread(target=lambda: seen.append(counts_cpu()))
        other.start()
        other.join()
    assert seen == [False]  # a thread started inside the block keeps wall-clock deadlines
