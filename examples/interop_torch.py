"""PyTorch as producer and as consumer, on a real GPU.

PyTorch exports CAI version 2 (no stream): cai_streams cannot know its pending work,
so the producer records it (`track` with the tensor's stream). As a consumer,
`torch.as_tensor` ignores the `stream` entry, so the consumer orders its own stream
with `cs.consume(..., stream=)` first.

    python examples/interop_torch.py        (prints what it needs on a machine without a GPU)
"""

from __future__ import annotations

import anyio
from _gpu import require

import cai_streams as cs

torch = require("torch")


async def main() -> None:
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        x = torch.arange(1 << 20, device="cuda", dtype=torch.float32) * 2
    t = cs.track(x)
    with t.writing(cs.Stream.wrap(side)):
        pass  # the work above, now known to cai_streams
    await cs.consume(t)  # waits for `side`, polling from the loop
    print(f"consume: tensor ready, sum {float(x.sum()):.0f}")

    mine = torch.cuda.Stream()
    view = await cs.consume(t, stream=cs.Stream.wrap(mine))  # `mine` waits on the GPU
    with torch.cuda.stream(mine):
        y = torch.as_tensor(view, device="cuda")  # reads view.__cuda_array_interface__
        total = float(y.sum())
    print(f"as_tensor on an ordered stream: sum {total:.0f}")


if __name__ == "__main__":
    anyio.run(main)
