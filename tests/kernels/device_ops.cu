// Kernels of the GPU tier's test ops (tests/device_ops.py, CupyOps).
// Compiled for sm_90 by tests/test_kernels_compile.py on every CI run, and
// loaded with cupy.RawModule on a GPU.

__device__ __forceinline__ unsigned long long global_ns() {
    unsigned long long t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
}

// Occupies its stream for `ns` nanoseconds (by the GPU's global timer, so the
// duration does not depend on the SM clock).
extern "C" __global__ void spin(unsigned long long ns) {
    unsigned long long start = global_ns();
    while (global_ns() - start < ns) {
        __nanosleep(1000);
    }
}

// Holds its stream until the host sets *flag (host-mapped pinned memory), or
// until `deadline_ns` has passed; then it sets *expired so the test fails
// instead of hanging every later device synchronization.
extern "C" __global__ void wait_flag(volatile int* flag, volatile int* expired,
                                     unsigned long long deadline_ns) {
    unsigned long long start = global_ns();
    while (*flag == 0) {
        if (global_ns() - start > deadline_ns) {
            *expired = 1;
            __threadfence_system();
            return;
        }
        __nanosleep(1000);
    }
}
