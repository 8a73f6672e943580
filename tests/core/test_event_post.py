"""EventPost: a step's events reach their event loop in one wakeup, in order, none lost."""

from __future__ import annotations

import asyncio
import threading

from engines.core.engine import TokenEvent
from engines.core.runner import EventPost


def test_a_steps_events_arrive_together_in_order_after_the_step() -> None:
    async def scenario() -> None:
        loop = asyncio.get_running_loop()
        post, first, second = EventPost(), asyncio.Queue(), asyncio.Queue()
        wakeups = 0
        original = loop.call_soon_threadsafe

        def counting(callback, *args):  # how many hand-overs reach the loop
            nonlocal wakeups
            wakeups += getattr(callback, "__name__", "") == "_deliver"
            return original(callback, *args)

        loop.call_soon_threadsafe = counting
        held_sizes = []

        def step() -> None:  # the scheduler thread: one step, events for two streams
            with post.holding():
                for index in range(3):
                    post.post(loop, first, TokenEvent(text=f"a{index}"))
                    post.post(loop, second, TokenEvent(text=f"b{index}"))
                held_sizes.append(wakeups)  # nothing handed over inside the step
            post.post(loop, first, TokenEvent(text="after"))  # between steps: at once

        await asyncio.to_thread(step)
        await asyncio.sleep(0)
        assert held_sizes == [0]
        assert wakeups == 2  # one for the whole step, one for the event after it
        assert [first.get_nowait().text for _ in range(4)] == ["a0", "a1", "a2", "after"]
        assert [second.get_nowait().text for _ in range(3)] == ["b0", "b1", "b2"]

    asyncio.run(scenario())


def test_other_threads_are_not_held_by_a_step_and_a_closed_loop_is_ignored() -> None:
    post, closed = EventPost(), asyncio.new_event_loop()
    closed.close()

    async def scenario() -> None:
        loop, queue = asyncio.get_running_loop(), asyncio.Queue()
        inside, release = threading.Event(), threading.Event()

        def step() -> None:
            with post.holding():
                post.post(closed, asyncio.Queue(), TokenEvent(text="nobody listens"))
                inside.set()
                release.wait(5)

        stepping = threading.Thread(target=step)
        stepping.start()
        inside.wait(5)
        await asyncio.to_thread(post.post, loop, queue, TokenEvent(text="from elsewhere"))
        assert (await asyncio.wait_for(queue.get(), 2)).text == "from elsewhere"
        release.set()
        await asyncio.to_thread(stepping.join, 5)

    asyncio.run(scenario())
