// Tensor-core building blocks as inline PTX: ldmatrix, int8 mma.sync, cp.async,
// and sm_90a's warpgroup MMA (wgmma) with its shared-memory descriptors.
//
// Fragment layouts (PTX ISA, "Matrix fragments for mma"), with
// g = lane >> 2 (group) and t = lane & 3 (thread in group):
//   m8n8k16 .s8:  A (8 x 16, row)  one register:  row g, k 4t .. 4t+3
//                 B (16 x 8, col)  one register:  col g, k 4t .. 4t+3
//                 C (8 x 8)        two registers: row g, cols 2t, 2t+1
//   m16n8k32 .s8: A (16 x 32) four registers: {row g, k 4t}, {row g+8, k 4t},
//                 {row g, k 16+4t}, {row g+8, k 16+4t}
//                 B (32 x 8) two registers: {col g, k 4t}, {col g, k 16+4t}
//                 C (16 x 8) four registers: {row g, cols 2t, 2t+1}, {row g+8, ...}
// ldmatrix .m8n8.x4 .b16 reads four 8 x 16-byte matrices; lanes 8q .. 8q+7 give
// the row addresses of matrix q, and register q of every lane receives row g,
// bytes 4t .. 4t+3 of matrix q: for int8 data stored k-contiguous that is one
// 8-row block of an A fragment, or one 8-column block of a B fragment.
#pragma once
#include "common.cuh"

namespace cupyops {

__device__ __forceinline__ unsigned shared_address(const void* pointer) {
  return static_cast<unsigned>(__cvta_generic_to_shared(pointer));
}

__device__ __forceinline__ void ldmatrix_x4(unsigned* dst, unsigned address) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(dst[0]), "=r"(dst[1]), "=r"(dst[2]), "=r"(dst[3])
               : "r"(address) : "memory");
}

// d += a * b for one m8n8k16 int8 tile (sm_75 and newer).
__device__ __forceinline__ void mma_m8n8k16_s8(int* d, const unsigned* a, const unsigned* b) {
  asm volatile("mma.sync.aligned.m8n8k16.row.col.s32.s8.s8.s32 {%0, %1}, {%2}, {%3}, {%0, %1};\n"
               : "+r"(d[0]), "+r"(d[1])
               : "r"(a[0]), "r"(b[0]));
}

// d += a * b for one m16n8k32 int8 tile (sm_80 and newer).
__device__ __forceinline__ void mma_m16n8k32_s8(int* d, const unsigned* a, const unsigned* b) {
  asm volatile("mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32 {%0, %1, %2, %3}, "
               "{%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
               : "+r"(d[0]), "+r"(d[1]), "+r"(d[2]), "+r"(d[3])
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

// 16 bytes from global to shared memory without registers; src_bytes 0 fills zeros
// (the source address is then not read, but must still be a valid one).
// Committed and awaited with cp_async_commit / cp_async_wait (common.cuh).
__device__ __forceinline__ void cp_async_16(unsigned dst, const void* src, int src_bytes) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(src_bytes) : "memory");
}

// -- wgmma (sm_90a) -------------------------------------------------------------
//
// wgmma.mma_async m64nNk32 .s32.s8.s8: a warpgroup (4 warps, 128 threads) computes
// D (64 x N) += A (64 x 32) * B (32 x N), A and B read from shared memory through
// 64-bit descriptors, both K-major (8-bit types allow no other). The accumulator
// fragment (PTX ISA, "Matrix fragments for wgmma .m64nNk32", CUTLASS's
// CLayout_64xN): warp w of the warpgroup holds rows 16w .. 16w+15, and within it
// lane (g = lane >> 2, t = lane & 3) holds d[4j + 2h + e] = D[16w + g + 8h][8j + 2t + e]
// -- per 8-column block j, the C fragment of mma.sync m16n8. Kernels keep it as
// int d[2][N / 8][2], d[h][j][e].
//
// Descriptor (PTX ISA, "Matrix Descriptor Format"): bits 0-13 start address >> 4,
// 16-29 leading-dimension byte offset >> 4, 32-45 stride-dimension byte offset
// >> 4, 49-51 base offset, 62-63 swizzle (1: 128B, 2: 64B, 3: 32B). Operands here
// are the convolution's shared tiles of R-byte rows (R = 32, 64 or 128 bytes of GEMM_K),
// vector v of row r at r * R + 16 * (v ^ ((r * R >> 7) & (R / 16 - 1))) -- CUTLASS's
// Swizzle<1,4,3> (32B, the copy engine's im2col tiles), Swizzle<2,4,3> (64B) or
// Swizzle<3,4,3> (128B) on shared addresses, whose pattern repeats every 8 rows. K-major with the R-byte swizzle: rows of an 8-row core
// group R bytes apart (implied by the mode), 8-row groups 8 R bytes apart (the
// stride offset); the leading offset is unused (a k32 slice, 32 bytes, lies within
// a row; 1, as CUTLASS writes it). Slice k starts 32 k bytes into the rows: the
// hardware applies the swizzle to the computed address, so the start address just
// moves by 32 k bytes. Tiles start on 8 R-byte boundaries, so the address bits
// of the pattern's phase are those of the row and the base offset stays 0.
constexpr int WGMMA_SWIZZLE_32B = 3;
constexpr int WGMMA_SWIZZLE_64B = 2;
constexpr int WGMMA_SWIZZLE_128B = 1;
constexpr int WGMMA_SWIZZLE_ROWS = 8;   // rows of a core group: the stride offset is 8 R bytes
constexpr int WGMMA_LEADING_BYTE_OFFSET_UNUSED = 1;

template <int ROW_BYTES>
__device__ __forceinline__ unsigned long long wgmma_descriptor(unsigned address) {
  static_assert(ROW_BYTES == 32 || ROW_BYTES == 64 || ROW_BYTES == 128, "32B, 64B or 128B swizzle");
  constexpr unsigned long long swizzle =
      ROW_BYTES == 128 ? WGMMA_SWIZZLE_128B : ROW_BYTES == 64 ? WGMMA_SWIZZLE_64B : WGMMA_SWIZZLE_32B;
  return static_cast<unsigned long long>((address & 0x3ffff) >> 4) |
         (static_cast<unsigned long long>(WGMMA_LEADING_BYTE_OFFSET_UNUSED) << 16) |
         (static_cast<unsigned long long>(WGMMA_SWIZZLE_ROWS * ROW_BYTES >> 4) << 32) | (swizzle << 62);
}
// A K-major operand without swizzle: 8-row core matrices of 16-byte rows, each 128
// contiguous bytes (the pattern CUTLASS calls INTERLEAVE); `leading_bytes` from a core
// matrix to the next along K (a k32 slice spans two), `stride_bytes` to the next 8 rows.
// The start need only be 16-byte aligned, so a tile may begin at any row.
__device__ __forceinline__ unsigned long long wgmma_descriptor_interleaved(unsigned address, unsigned leading_bytes,
                                                                           unsigned stride_bytes) {
  return static_cast<unsigned long long>((address & 0x3ffff) >> 4) |
         (static_cast<unsigned long long>(leading_bytes >> 4) << 16) |
         (static_cast<unsigned long long>(stride_bytes >> 4) << 32);
}
__device__ __forceinline__ unsigned long long wgmma_descriptor_sw64(unsigned address) {
  return wgmma_descriptor<64>(address);
}

// `descriptor` with its start address moved by `units` 16-byte units: a 32-bit
// add to the low word, which holds the start address in bits 0-13 and never
// carries out of it (shared addresses stay below 2^18 bytes).
__device__ __forceinline__ unsigned long long wgmma_descriptor_moved(unsigned long long descriptor, unsigned units) {
  return (descriptor & 0xffffffff00000000ull) | (static_cast<unsigned>(descriptor) + units);
}

// wgmma_m64nNk32 s8: WgmmaS8<N>::mma(d, a_descriptor, b_descriptor), d += A * B.
// Its operand list (N / 2 accumulator registers) is written out per N by the
// rendering template (templates/wgmma.j2), which defines the specialisation each
// translation unit uses.
template <int N>
struct WgmmaS8;

// Orders this thread's generic-proxy shared-memory writes (cp.async included)
// before later async-proxy reads (wgmma) once a barrier has been passed.
__device__ __forceinline__ void fence_proxy_async_shared() {
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
}
// wgmma.fence: orders prior register and shared-memory accesses before the wgmma that follow.
__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
// Waits until at most `pending` committed wgmma groups of this warpgroup are in flight.
template <int pending>
__device__ __forceinline__ void wgmma_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(pending) : "memory");
}
// Zeroes a warpgroup's wgmma accumulators.
template <int ROWS, int COLS>
__device__ __forceinline__ void zero_accumulators(int (&acc)[ROWS][COLS][2]) {
#pragma unroll
  for (int h = 0; h < ROWS; ++h)
#pragma unroll
    for (int j = 0; j < COLS; ++j) acc[h][j][0] = acc[h][j][1] = 0;
}

// Pins the accumulators at this point of the program (no code is emitted): the
// compiler may not move their reads or writes across it, so none lands while a
// wgmma that writes them is in flight.
template <int ROWS, int COLS>
__device__ __forceinline__ void wgmma_fence_operands(int (&d)[ROWS][COLS][2]) {
#pragma unroll
  for (int i = 0; i < ROWS; ++i)
#pragma unroll
    for (int j = 0; j < COLS; ++j) asm volatile("" : "+r"(d[i][j][0]), "+r"(d[i][j][1])::"memory");
}

}  // namespace cupyops
