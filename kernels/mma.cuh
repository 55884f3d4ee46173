// Tensor-core building blocks as inline PTX: ldmatrix, int8 mma.sync, cp.async.
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

}  // namespace cupyops
