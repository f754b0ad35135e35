"""Turns run one at a time, in the order they were taken, whatever the threads do."""

from __future__ import annotations

import random
import threading
import time

from bridge_py.worker.sequencer import Sequencer


def test_turns_run_in_the_order_taken_even_when_threads_start_out_of_order() -> None:
    seq = Sequencer()
    turns = [seq.turn() for _ in range(40)]
    ran: list[int] = []
    inside = [0]
    most_inside = [0]

    def run(i: int) -> None:
        time.sleep(random.random() * 0.01)  # threads reach their turn in random order
        with turns[i]:
            inside[0] += 1
            most_inside[0] = max(most_inside[0], inside[0])
            ran.append(i)
            inside[0] -= 1

    threads = [threading.Thread(target=run, args=(i,)) for i in reversed(range(40))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert ran == list(range(40))
    assert most_inside[0] == 1


def test_a_turn_left_by_an_exception_lets_the_next_one_run() -> None:
    seq = Sequencer()
    first, second = seq.turn(), seq.turn()
    try:
        with first:
            raise ValueError("boom")
    except ValueError:
        pass
    done = threading.Event()

    def run() -> None:
        with second:
            done.set()

    threading.Thread(target=run).start()
    assert done.wait(5)
