// Kernels of the cuda benchmarks (benchmarks/run.py --backend cuda).
// Loaded with cupy.RawModule(code=...) on a GPU; plain CUDA C++ that
// `nvcc -arch=sm_90 -c` compiles with no extra flags.
//
// Time on the device is read from %globaltimer (nanoseconds, the same clock
// on every SM), so durations do not depend on the SM clock and completion
// stamps can be converted to host time (see benchmarks/cuda_device.py).

__device__ __forceinline__ unsigned long long global_ns() {
    unsigned long long t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
}

// Writes the device clock to *out (host-mapped pinned memory): the host spins
// on it to calibrate %globaltimer against its own clock.
extern "C" __global__ void stamp_now(volatile unsigned long long* out) {
    *out = global_ns();
    __threadfence_system();
}

// Smallest step of %globaltimer seen over `reads` consecutive reads.
extern "C" __global__ void timer_step(unsigned long long* out, int reads) {
    unsigned long long last = global_ns();
    unsigned long long step = ~0ULL;
    for (int i = 0; i < reads; ++i) {
        unsigned long long now = global_ns();
        if (now != last && now - last < step) {
            step = now - last;
        }
        last = now;
    }
    *out = step;
}

// One waiter's work: busy for `ns` nanoseconds, then stamps[index] = the
// device clock at the end (the completion time that wake latency is
// measured from).
extern "C" __global__ void spin_then_stamp(unsigned long long ns, unsigned long long* stamps,
                                           int index) {
    unsigned long long start = global_ns();
    unsigned long long now = start;
    while (now - start < ns) {
        now = global_ns();
    }
    stamps[index] = global_ns();
}

// Occupies its stream for `ns` nanoseconds (the pipeline's fixed-time kernel).
extern "C" __global__ void spin(unsigned long long ns) {
    unsigned long long start = global_ns();
    while (global_ns() - start < ns) {
        __nanosleep(500);
    }
}

// Holds its stream until the host sets *flag (host-mapped pinned memory), or
// until `timeout_ns` has passed; then it sets *expired, so a benchmark that
// never opens its gate is cut short instead of hanging.
extern "C" __global__ void gate(volatile int* flag, volatile int* expired,
                                unsigned long long timeout_ns) {
    unsigned long long start = global_ns();
    while (*flag == 0) {
        if (global_ns() - start > timeout_ns) {
            *expired = 1;
            __threadfence_system();
            return;
        }
        __nanosleep(1000);
    }
}

// The pipeline's preprocessing: out = 2 * in + 1 + bias (inputs are small
// integers, so every value is exact in float32).
extern "C" __global__ void preprocess(float* out, const float* in, long long n, float bias) {
    long long stride = (long long)gridDim.x * blockDim.x;
    for (long long j = (long long)blockIdx.x * blockDim.x + threadIdx.x; j < n; j += stride) {
        out[j] = 2.0f * in[j] + 1.0f + bias;
    }
}

// Adds the (integer) sum of x[0:n] to *total; blockDim.x must be 256.
extern "C" __global__ void checksum(const float* x, long long n, unsigned long long* total) {
    __shared__ unsigned long long partial[256];
    unsigned long long local = 0;
    long long stride = (long long)gridDim.x * blockDim.x;
    for (long long j = (long long)blockIdx.x * blockDim.x + threadIdx.x; j < n; j += stride) {
        local += (unsigned long long)x[j];
    }
    partial[threadIdx.x] = local;
    __syncthreads();
    for (int s = blockDim.x / 2; s > 0; s >>= 1) {
        if (threadIdx.x < s) {
            partial[threadIdx.x] += partial[threadIdx.x + s];
        }
        __syncthreads();
    }
    if (threadIdx.x == 0) {
        atomicAdd(total, partial[0]);
    }
}
