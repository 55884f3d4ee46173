// Philox4x32-10 (Salmon et al., "Parallel random numbers: as easy as 1, 2, 3",
// the Random123 generator) and the dropout keep mask every kernel family uses.
// The mask depends only on (element index, p, seed, offset): never on the
// launch configuration, the plan or the GPU. cupyops/philox.py is the
// NumPy reference of the same rule.
#pragma once

namespace cupyops {

__device__ __forceinline__ uint4 philox4x32_10(uint4 counter, uint2 key) {
  const unsigned M0 = 0xD2511F53u, M1 = 0xCD9E8D57u;
  const unsigned W0 = 0x9E3779B9u, W1 = 0xBB67AE85u;
#pragma unroll
  for (int round = 0; round < 10; ++round) {
    const unsigned hi0 = __umulhi(M0, counter.x), lo0 = M0 * counter.x;
    const unsigned hi1 = __umulhi(M1, counter.z), lo1 = M1 * counter.z;
    counter = make_uint4(hi1 ^ counter.y ^ key.x, lo1, hi0 ^ counter.w ^ key.y, lo0);
    key.x += W0;
    key.y += W1;
  }
  return counter;
}

// Element `index` is kept iff word (n & 3) of Philox(counter = n >> 2, key = seed)
// is >= threshold, with n = index + offset and threshold = floor(p * 2^32)
// (cupyops.philox.dropout_threshold; p = 0 keeps everything).
struct DropoutMask {
  unsigned long long seed;
  unsigned long long offset;
  unsigned int threshold;

  __device__ __forceinline__ uint4 words(unsigned long long group) const {
    return philox4x32_10(
        make_uint4(static_cast<unsigned>(group), static_cast<unsigned>(group >> 32), 0u, 0u),
        make_uint2(static_cast<unsigned>(seed), static_cast<unsigned>(seed >> 32)));
  }
  __device__ __forceinline__ static unsigned word(const uint4& w, unsigned lane) {
    return lane == 0 ? w.x : lane == 1 ? w.y : lane == 2 ? w.z : w.w;
  }
  __device__ __forceinline__ bool keep(unsigned long long index) const {
    const unsigned long long n = index + offset;
    return word(words(n >> 2), static_cast<unsigned>(n & 3)) >= threshold;
  }
  // kept[j] = keep(first_index + j): one Philox call per group of 4 counter words.
  template <int N>
  __device__ __forceinline__ void keep_pack(unsigned long long first_index, bool (&kept)[N]) const {
    const unsigned long long first = first_index + offset;
    unsigned long long group = first >> 2;
    uint4 w = words(group);
#pragma unroll
    for (int j = 0; j < N; ++j) {
      const unsigned long long n = first + j;
      if ((n >> 2) != group) {
        group = n >> 2;
        w = words(group);
      }
      kept[j] = word(w, static_cast<unsigned>(n & 3)) >= threshold;
    }
  }
};

}  // namespace cupyops
