"""The rank actor's outbox (serve/ep_ranks._Outbox, _Job): items put from the step loop's thread come out in order,
batched per take; a job that does not stream sends only its first event; a second subscriber takes over and the
first one ends. In one process, without Ray actors."""

from __future__ import annotations

import asyncio
import threading

import pytest

pytest.importorskip("ray", reason="Ray is not installed (pip install -e '.[ray]')")

from moeserve.serve.ep_ranks import _Job, _Outbox  # noqa: E402  (needs ray)


def test_items_from_another_thread_come_in_order_batched():
    async def main():
        box = _Outbox()
        turn = box.subscribe(asyncio.get_running_loop())

        def step_loop():
            for i in range(50):
                box.put("a" if i % 2 else "b", ("event", 0, i))
            box.put("a", ("done", []))

        t = threading.Thread(target=step_loop)
        t.start()
        got = []
        while not got or got[-1] != ("a", ("done", [])):
            batch = await asyncio.wait_for(box.take(turn), 5)
            assert batch
            got += batch
        t.join()
        return got

    got = asyncio.run(main())
    assert [item[2] for _, item in got[:-1]] == list(range(50))  # every item once, in order
    assert [j for j, _ in got[:-1]] == ["a" if i % 2 else "b" for i in range(50)]


def test_items_put_before_the_subscriber_are_kept():
    async def main():
        box = _Outbox()
        box.put("a", ("first",))
        return await asyncio.wait_for(box.take(box.subscribe(asyncio.get_running_loop())), 5)

    assert asyncio.run(main()) == [("a", ("first",))]


def test_a_job_that_does_not_stream_sends_its_first_event_only():
    box = _Outbox()
    job = _Job("j", 2, False, box)
    emit0, emit1 = job.on_event(0), job.on_event(1)
    emit1("e1")
    emit0("e0")
    emit1("e2")
    streamed = _Job("s", 1, True, box)
    streamed.on_event(0)("x")
    assert box._items == [("j", ("first",)), ("s", ("event", 0, "x"))]
    assert [job.one_done(), job.one_done()] == [False, True]  # the last of its 2 sequences


def test_a_second_subscriber_takes_over():
    async def main():
        box = _Outbox()
        loop = asyncio.get_running_loop()
        first = box.subscribe(loop)
        waiting = asyncio.ensure_future(box.take(first))
        await asyncio.sleep(0.01)
        second = box.subscribe(loop)
        assert await asyncio.wait_for(waiting, 5) is None
        box.put("a", ("first",))
        return await asyncio.wait_for(box.take(second), 5)

    assert asyncio.run(main()) == [("a", ("first",))]
