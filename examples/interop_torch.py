"""PyTorch as producer and as consumer, on a real GPU, every answer checked.

PyTorch exports CAI version 2, with no ``stream`` entry: an untracked tensor
looks ready whatever is pending on it. So the producer records its work:
``with cs.track(x).writing(stream):``. As a consumer, ``torch.as_tensor``
ignores the ``stream`` entry, so the consumer's stream is ordered first with
``cs.consume(..., stream=)``.

1. ``await cs.consume(x)`` of a tracked tensor waits (polling) for the
   kernels enqueued inside ``writing(side)``.
2. ``cs.consume(x, stream=mine)``: ``mine`` waits for ``side`` on the GPU,
   then reads the tensor through its CAI.
3. Write after read: leaving ``cs.consuming(x, stream=mine)`` makes the
   producer's next ``writing()`` wait for the reader.

Every check reads on a stream that does not wait for the producer (PyTorch's
streams are non-blocking), so a missing wait shows as a wrong answer, and the
script exits 1.

    python examples/interop_torch.py        (prints what it needs on a machine without a GPU)
"""

from __future__ import annotations

import anyio
from _gpu import check, require

import cai_streams as cs

torch = require("torch")

N = 1 << 22
ROUNDS = 100


async def main() -> None:
    side = torch.cuda.Stream()
    x = torch.zeros(N, device="cuda")
    torch.cuda.current_stream().synchronize()  # `side` does not wait for the default stream
    assert "stream" not in x.__cuda_array_interface__  # version 2: nothing to wait for
    t = cs.track(x)
    with t.writing(side), torch.cuda.stream(side):
        for _ in range(ROUNDS):
            x += 1  # known to cai_streams: enqueued on `side` inside writing()
    await cs.consume(x)  # the tensor is tracked: waits for `side`, polling from the loop
    check(1, "await cs.consume waited for the tracked tensor's writes",
          bool((x == ROUNDS).all()), f"expected {ROUNDS} everywhere")  # fmt: skip

    mine = torch.cuda.Stream()
    with t.writing(side), torch.cuda.stream(side):
        for _ in range(ROUNDS):
            x += 1
    view = await cs.consume(x, stream=mine)  # `mine` waits on the GPU; no host wait
    with torch.cuda.stream(mine):
        y = torch.as_tensor(view, device="cuda")  # ignores view.stream: `mine` is ordered
        ok = bool((y == 2 * ROUNDS).all())
    check(2, "torch stream ordered by cs.consume(stream=)", ok,
          f"expected {2 * ROUNDS} everywhere")  # fmt: skip

    async with cs.consuming(x, stream=mine) as view:
        with torch.cuda.stream(mine):
            y = torch.as_tensor(view, device="cuda")
            seen = torch.zeros_like(y)
            for _ in range(ROUNDS):
                seen += y  # reads x ROUNDS times, on `mine`
    with t.writing(side), torch.cuda.stream(side):  # waits for the reads on `mine`
        x += 1
    await cs.consume(x)  # the new value is ready too
    with torch.cuda.stream(mine):
        ok = bool((seen == 2 * ROUNDS * ROUNDS).all())
    check(3, "the producer waited for the reader (write after read)",
          ok and bool((x == 2 * ROUNDS + 1).all()), "the reader saw a later write")  # fmt: skip


if __name__ == "__main__":
    anyio.run(main)
