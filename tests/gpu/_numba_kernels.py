"""The Numba kernels of the GPU tier.

Import this module only after ``pytest.importorskip("numba.cuda")``: importing
numba.cuda the first time warns under numpy 2.5 (a DeprecationWarning, an
error in this suite), and importorskip is what silences it. Launch with
``GRID`` blocks: numba-cuda warns (NumbaPerformanceWarning) below 128.
"""

from __future__ import annotations

from numba import cuda

GRID, BLOCK = 128, 32


@cuda.jit
def fill(x, value):  # type: ignore[no-untyped-def]
    i = cuda.grid(1)
    if i < x.size:
        x[i] = value


@cuda.jit
def copy(dst, src):  # type: ignore[no-untyped-def]
    i = cuda.grid(1)
    if i < dst.size:
        dst[i] = src[i]
