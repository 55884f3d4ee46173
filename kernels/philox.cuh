// Philox4x32-10 (Salmon et al., "Parallel random numbers: as easy as 1, 2, 3",
// the Random123 generator) and the dropout keep mask every kernel family uses.
// The mask depends only on (element index, p, seed, offset): never on the
// launch configuration, the plan or the GPU. cupyops/philox.py is the
// NumPy reference of the same rule.
#pragma once

namespace cupyops {

// The ten rounds, round r's key key_at(r) (a uint2).
template <typename KeyAt>
__device__ __forceinline__ uint4 philox_rounds(uint4 counter, const KeyAt& key_at) {
  const unsigned M0 = 0xD2511F53u, M1 = 0xCD9E8D57u;
#pragma unroll
  for (int round = 0; round < 10; ++round) {
    const uint2 key = key_at(round);
    const unsigned hi0 = __umulhi(M0, counter.x), lo0 = M0 * counter.x;
    const unsigned hi1 = __umulhi(M1, counter.z), lo1 = M1 * counter.z;
    counter = make_uint4(hi1 ^ counter.y ^ key.x, lo1, hi0 ^ counter.w ^ key.y, lo0);
  }
  return counter;
}

// The Weyl steps Philox adds to its key each round.
constexpr unsigned kPhiloxW0 = 0x9E3779B9u, kPhiloxW1 = 0xBB67AE85u;

__device__ __forceinline__ uint4 philox4x32_10(uint4 counter, uint2 key) {
  return philox_rounds(counter, [&](int round) {
    return make_uint2(key.x + round * kPhiloxW0, key.y + round * kPhiloxW1);
  });
}

// A key's ten round keys, key + round * (W0, W1), made on the host (cupyops.philox.round_keys)
// and passed as a kernel parameter: each round's XOR reads its key where the parameters lie,
// with no sums in the kernel.
struct RoundKeys {
  unsigned lo[10], hi[10];
};

__device__ __forceinline__ uint4 philox4x32_10(uint4 counter, const RoundKeys& keys) {
  return philox_rounds(counter, [&](int round) { return make_uint2(keys.lo[round], keys.hi[round]); });
}

// The key a DropoutMaskOf holds, as philox4x32_10 takes it: a seed's (low, high) words, or RoundKeys.
__device__ __forceinline__ uint2 philox_key(unsigned long long seed) {
  return make_uint2(static_cast<unsigned>(seed), static_cast<unsigned>(seed >> 32));
}
__device__ __forceinline__ const RoundKeys& philox_key(const RoundKeys& keys) { return keys; }

// Element `index` is kept iff 16-bit half (n & 7) of Philox(counter = n >> 3, key = seed) is
// >= threshold, with n = index + offset, half h the (h & 1)-th half (low first) of word h >> 1,
// and threshold = round(p * 2^16), at most 2^16 - 1 (cupyops.philox.dropout_threshold; p = 0
// keeps everything): one Philox call serves eight elements. Key: the seed (unsigned long long,
// DropoutMask) or its RoundKeys (KeyedDropoutMask).
template <typename Key>
struct DropoutMaskOf {
  Key key;
  unsigned long long offset;
  unsigned int threshold;

  __device__ __forceinline__ uint4 words(unsigned long long group) const {
    return philox4x32_10(make_uint4(static_cast<unsigned>(group), static_cast<unsigned>(group >> 32), 0u, 0u),
                         philox_key(key));
  }
  // Bit h set iff element h of the group of eight is kept.
  __device__ __forceinline__ unsigned kept_bits(unsigned long long group) const {
    const uint4 w = words(group);
    const unsigned word[4] = {w.x, w.y, w.z, w.w};
    unsigned bits = 0;
#pragma unroll
    for (int h = 0; h < 8; ++h) {
      bits |= static_cast<unsigned>(((word[h >> 1] >> (16 * (h & 1))) & 0xFFFFu) >= threshold) << h;
    }
    return bits;
  }
  __device__ __forceinline__ bool keep(unsigned long long index) const {
    const unsigned long long n = index + offset;
    return (kept_bits(n >> 3) >> (n & 7)) & 1u;
  }
  // kept[j] = keep(first_index + j), N <= 8: the pack spans one group of eight, or two.
  template <int N>
  __device__ __forceinline__ void keep_pack(unsigned long long first_index, bool (&kept)[N]) const {
    static_assert(N <= 8, "a pack spans at most two groups");
    const unsigned long long first = first_index + offset;
    const unsigned start = static_cast<unsigned>(first & 7);
    unsigned bits = kept_bits(first >> 3);
    if (start + N > 8) bits |= kept_bits((first >> 3) + 1) << 8;
    bits >>= start;
#pragma unroll
    for (int j = 0; j < N; ++j) kept[j] = (bits >> j) & 1u;
  }
};

typedef DropoutMaskOf<unsigned long long> DropoutMask;
typedef DropoutMaskOf<RoundKeys> KeyedDropoutMask;

// The same mask where every pack the kernel asks for starts a group of eight (packs of 8 at
// multiples of 8 in rows of a multiple of 8, and offset a multiple of 8): each element's half
// is compared in its word, a high half as word >= threshold << 16, a low one as
// (word << 16) >= threshold << 16, with no bits gathered and no second group.
struct GroupedDropoutMask : KeyedDropoutMask {
  // (Packs of other sizes, which such kernels instantiate but never run, take KeyedDropoutMask's.)
  template <int N>
  __device__ __forceinline__ void keep_pack(unsigned long long first_index, bool (&kept)[N]) const {
    if constexpr (N != 8) {
      KeyedDropoutMask::keep_pack<N>(first_index, kept);
    } else {
      const uint4 w = words((first_index + offset) >> 3);
      const unsigned word[4] = {w.x, w.y, w.z, w.w};
      const unsigned bound = threshold << 16;
#pragma unroll
      for (int j = 0; j < N; ++j) kept[j] = ((j & 1) ? word[j >> 1] : word[j >> 1] << 16) >= bound;
    }
  }
};

}  // namespace cupyops
