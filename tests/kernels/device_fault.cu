// A kernel that faults on purpose (tests/gpu/test_device_fault.py, in a child
// process): a store to an address no allocation holds, which the driver
// reports as cudaErrorIllegalAddress (700), sticky for the context.

extern "C" __global__ void store_to_an_unmapped_address() {
    *reinterpret_cast<volatile int*>(static_cast<unsigned long long>(8)) = 1;
}
