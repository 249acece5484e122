"""The producer-to-consumer handoff under trio.

A producer task fills buffers on its stream and passes them through a trio memory
channel; the consumer awaits each with `cs.consume`, which polls from trio's own
loop through a trio system task. A timeout and a cancellation show that an abandoned
wait leaks nothing. Its kernels are simulated (`sim.launch`), so it selects the
simulated device itself and runs the same with or without a GPU.

    python examples/trio_pipeline.py
"""

from __future__ import annotations

import trio

import cai_streams as cs
from cai_streams import sim


async def main() -> None:
    cs.use_backend("sim")  # simulated kernels need simulated streams, even on a GPU machine
    s = cs.Stream()
    send, receive = trio.open_memory_channel[sim.SimArray](4)
    baseline = cs.stats()["events_in_flight"]

    async def producer() -> None:
        async with send:
            for i in range(20):
                buf = sim.empty(256, "float32")
                buf.stream = s.handle
                sim.launch(s, lambda x, v=i: x.fill(v), buf, writes=[buf], duration=0.002)
                await send.send(buf)

    async def consumer() -> None:
        async with receive:
            i = 0
            async for buf in receive:
                view = await cs.consume(buf, timeout=10)
                data = sim.host_view(view)
                assert (data == i).all()
                i += 1
        print(f"trio consumer took {i} buffers, every one complete")

    async with trio.open_nursery() as nursery:
        nursery.start_soon(producer)
        nursery.start_soon(consumer)

    slow = sim.empty(8)
    slow.stream = s.handle
    sim.launch(s, lambda x: x.fill(1), slow, writes=[slow], duration=0.2)
    try:
        await cs.consume(slow, timeout=0.01)
    except TimeoutError:
        print("a 10 ms timeout on 200 ms of work raised TimeoutError")
    with trio.move_on_after(0.01):
        await cs.consume(slow)
    await s.record().wait()  # (a blocking synchronize here would stall the loop)
    print(f"events still in flight after the abandoned waits: "
          f"{cs.stats()['events_in_flight'] - baseline}")  # fmt: skip


if __name__ == "__main__":
    trio.run(main)
