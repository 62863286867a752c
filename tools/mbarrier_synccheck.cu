// The stage pipeline of the register-level kernels (crate `stages.rs`), reduced to CUDA's
// documented primitives, for compute-sanitizer's synccheck: each thread issues 16-byte
// asynchronous copies into a stage, ties their completion to the stage's barrier with
// `__pipeline_arrive_on` (`cp.async.mbarrier.arrive`, the pending count raised by one and
// lowered when the copies land, as the CUDA programming guide describes), then arrives and
// waits on that barrier before reading the stage.
//
//   nvcc -arch=sm_90 -o mbarrier_synccheck tools/mbarrier_synccheck.cu
//   compute-sanitizer --tool synccheck ./mbarrier_synccheck arrive-on   # the kernels' form
//   compute-sanitizer --tool synccheck ./mbarrier_synccheck wait-group  # cp.async.wait_group
//
// Both forms print the same sums (checked against the host); what synccheck reports on each
// tells whether its reports on the kernels come from the form itself.
#include <cuda/barrier>
#include <cuda_pipeline.h>

#include <cstdio>
#include <cstring>
#include <vector>

constexpr int kUnits = 128;
constexpr int kBlocks = 16;

using Barrier = cuda::barrier<cuda::thread_scope_block>;

template <bool kArriveOn>
__global__ void stream(const int4* src, int* out) {
    __shared__ int4 tile[2][kUnits];
    __shared__ Barrier landed[2];
    const int unit = threadIdx.x;
    const int4* cube_src = src + blockIdx.x * kBlocks * kUnits;
    if (unit == 0) {
        init(&landed[0], kUnits);
        init(&landed[1], kUnits);
    }
    __syncthreads();
    __pipeline_memcpy_async(&tile[0][unit], &cube_src[unit], sizeof(int4));
    if (kArriveOn) {
        __pipeline_arrive_on(cuda::device::barrier_native_handle(landed[0]));
    } else {
        __pipeline_commit();
    }
    int sum = 0;
    for (int block = 0; block < kBlocks; ++block) {
        const int stage = block % 2;
        if (!kArriveOn) {
            __pipeline_wait_prior(0);
        }
        // Every unit is done with the other stage: refill it.
        landed[stage].arrive_and_wait();
        if (block + 1 < kBlocks) {
            const int4* next = &cube_src[(block + 1) * kUnits + unit];
            __pipeline_memcpy_async(&tile[1 - stage][unit], next, sizeof(int4));
            if (kArriveOn) {
                __pipeline_arrive_on(cuda::device::barrier_native_handle(landed[1 - stage]));
            } else {
                __pipeline_commit();
            }
        }
        // A neighbour's copy: visible through the barrier only.
        const int4 v = tile[stage][(unit + 1) % kUnits];
        sum += v.x + v.y + v.z + v.w;
    }
    out[blockIdx.x * kUnits + unit] = sum;
}

int main(int argc, char** argv) {
    const bool arrive_on = argc < 2 || std::strcmp(argv[1], "wait-group") != 0;
    const int cubes = 4;
    const int elements = cubes * kBlocks * kUnits;
    std::vector<int4> host(elements);
    for (int i = 0; i < elements; ++i) {
        host[i] = make_int4(i, 2 * i, -i, 3);
    }
    int4* src;
    int* out;
    cudaMalloc(&src, elements * sizeof(int4));
    cudaMalloc(&out, cubes * kUnits * sizeof(int));
    cudaMemcpy(src, host.data(), elements * sizeof(int4), cudaMemcpyHostToDevice);
    if (arrive_on) {
        stream<true><<<cubes, kUnits>>>(src, out);
    } else {
        stream<false><<<cubes, kUnits>>>(src, out);
    }
    std::vector<int> got(cubes * kUnits);
    cudaMemcpy(got.data(), out, got.size() * sizeof(int), cudaMemcpyDeviceToHost);
    int wrong = 0;
    for (int c = 0; c < cubes; ++c) {
        for (int u = 0; u < kUnits; ++u) {
            int want = 0;
            for (int b = 0; b < kBlocks; ++b) {
                const int4 v = host[(c * kBlocks + b) * kUnits + (u + 1) % kUnits];
                want += v.x + v.y + v.z + v.w;
            }
            wrong += got[c * kUnits + u] != want;
        }
    }
    std::printf("%s: %d of %d sums wrong (%s)\n", arrive_on ? "arrive-on" : "wait-group", wrong,
                cubes * kUnits, cudaGetErrorString(cudaGetLastError()));
    return wrong != 0;
}
