"""GPU diagnostic for test_a_global_capture_in_another_thread_survives_thousands_of_polled_waiters.

On an H100 (2026-11-23) that test lost 20 s somewhere after the capture thread
began its global capture: the latches gave up before the poll loop made its 20
passes. This runs the test's scenario outside pytest and prints, every second,
the poller's counters and, at 3, 6 and 12 s, the Python stack of every thread
(a thread stuck in a driver call shows the library or CuPy call that made it),
then an all-thread dump at 25 s. The kernels are compiled and loaded first, so
nothing of that shows up.

Found on an H100 (2026-11-23, second session): the capture thread was in
``CupyOps.array``'s ``cudaStreamSynchronize(0)`` at 3, 6 and 12 s, its legacy-stream
copy waiting behind the eight held non-blocking streams until their latches gave
up; the test now makes that array before it latches (scripts/probe-legacy-copy.py).

    PYTHONPATH=.:SITE python3 scripts/diagnose-capture-poll.py [WAITERS] [WAKE] [--no-sanitizer]

WAKE is a PollPolicy wake mode ("auto", "doorbell", "poll"); the failing runs rang
bells ("auto" did on cuda then), so try "doorbell" and "poll". The sanitizer is on,
as in the suite (which declares the CuPy kernels' accesses to it), unless
``--no-sanitizer``: run both, to tell whether it takes part. Blocks for at most
about 45 s (the test's own bounds); needs a CUDA device, CuPy and the tests/.
"""

from __future__ import annotations

import faulthandler
import sys
import threading
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import cai_streams as cs  # noqa: E402
from cai_streams import _poller  # noqa: E402
from tests import test_capture  # noqa: E402
from tests.device_ops import ops_for  # noqa: E402


def main() -> None:
    args = [a for a in sys.argv[1:] if a != "--no-sanitizer"]
    sanitize = "--no-sanitizer" not in sys.argv
    waiters = int(args[0]) if args else test_capture.WAITERS
    if len(args) > 1:
        cs.configure(poll=cs.PollPolicy(wake=args[1]))  # type: ignore[arg-type]
    cs.use_backend("cuda")
    ops = ops_for("cuda")  # compiles and loads every test kernel now
    test_capture.WAITERS = waiters
    print(f"waiters {waiters}, sanitizer {sanitize}, {_poller.poll_policy()}", flush=True)
    started = time.perf_counter()
    stop = threading.Event()

    def monitor() -> None:
        second = 0
        while not stop.wait(1.0):
            second += 1
            c = _poller.counters
            print(f"[{time.perf_counter() - started:5.1f} s] passes {c.passes} "
                  f"queries {c.queries} wakes {c.wakes}", flush=True)  # fmt: skip
            if second in (3, 6, 12):
                names = {t.ident: t.name for t in threading.enumerate()}
                for ident, frame in sys._current_frames().items():
                    if ident == threading.get_ident():
                        continue
                    print(f"--- thread {names.get(ident, ident)}", flush=True)
                    print("".join(traceback.format_stack(frame)[-10:]), flush=True)

    threading.Thread(target=monitor, name="monitor", daemon=True).start()
    faulthandler.dump_traceback_later(25, exit=False)
    try:
        with cs.sanitize(sanitize):
            found = test_capture._poll_during_a_capture(ops)
        print("outcome, errors, passes:", found, flush=True)
    except BaseException as exc:  # the scenario's own failure is the finding
        print("raised:", repr(exc)[:2000], flush=True)
    finally:
        stop.set()
        faulthandler.cancel_dump_traceback_later()
        ops.release_all()


if __name__ == "__main__":
    main()
