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


def test_no_wake_up_is_lost_when_turns_hand_over_quickly() -> None:
    # Turns are taken and left without a lock when nobody waits; a turn that must
    # wait sleeps on the condition. Two threads that take turns about hand over
    # 4,000 times, many of them to a thread that is just going to sleep: a lost
    # wake-up leaves both asleep for good (caught by the joins' deadline).
    seq = Sequencer()
    turns = [seq.turn() for _ in range(4000)]
    ran: list[int] = []

    def run(first: int) -> None:
        for turn_index in range(first, len(turns), 2):
            with turns[turn_index]:
                ran.append(turn_index)

    threads = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(2)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 20
    for t in threads:
        t.join(max(0.0, deadline - time.monotonic()))
    assert not any(t.is_alive() for t in threads), f"stuck after {len(ran)} turns"
    assert ran == list(range(4000))
