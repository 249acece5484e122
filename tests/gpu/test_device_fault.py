"""A real device-side fault, in a child process (it poisons the CUDA context
for good): the driver's sticky error reaches the user as
``cs.DeviceFaultError``, as the simulator's ``KernelError`` does, and the
library's fault handling lets an owner go instead of keeping it for good."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

_CHILD = textwrap.dedent(
    """
    import gc, sys, warnings
    import cupy
    import cai_streams as cs

    warnings.simplefilter("error", cs.CudaWarning)  # ("kept ... alive for good") fails

    cs.use_backend("cuda")
    source = open(sys.argv[1]).read()
    bad = cupy.RawModule(code=source, options=("-std=c++17",)).get_function(
        "store_to_an_unmapped_address"
    )
    s, c = cs.Stream(), cs.Stream()
    t = cs.track(cupy.zeros(16, cupy.float32))
    with t.writing(s):
        with cupy.cuda.ExternalStream(s.handle):
            t.array.fill(1)
    view = cs.consume_blocking(t, stream=c)  # the owner leased to c
    s.synchronize()
    with cupy.cuda.ExternalStream(s.handle):
        bad((1,), (1,), ())
    try:
        s.synchronize()
    except cs.DeviceFaultError as exc:
        print(f"fault {exc.code} {exc.name} {type(exc).__name__}")
    else:
        print("no fault")
    del view, t
    for _ in range(3):
        gc.collect()
        try:
            cs.stats()
        except cs.DeviceFaultError:
            pass
    print("owner let go")
    """
)


def test_a_real_fault_is_a_device_fault_and_lets_owners_go() -> None:
    pytest.importorskip("cupy")
    source = Path(__file__).resolve().parents[1] / "kernels" / "device_fault.cu"
    out = subprocess.run(
        [sys.executable, "-c", _CHILD, str(source)], capture_output=True, text=True, timeout=120
    )
    assert "fault 7" in out.stdout and "DeviceFaultError" in out.stdout, out.stdout + out.stderr
    assert "owner let go" in out.stdout, out.stdout + out.stderr
