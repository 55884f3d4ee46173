// Fused elementwise kernels: the math of cupyops.fx in float and double, and
// the ways an operand is read at the output's linear index (its broadcast).
#pragma once

#include "common.cuh"

namespace cupyops {

// -- math, one overload per compute type --------------------------------------------------
__device__ __forceinline__ float fx_exp(float x) { return expf(x); }
__device__ __forceinline__ double fx_exp(double x) { return exp(x); }
__device__ __forceinline__ float fx_log(float x) { return logf(x); }
__device__ __forceinline__ double fx_log(double x) { return log(x); }
__device__ __forceinline__ float fx_tanh(float x) { return tanhf(x); }
__device__ __forceinline__ double fx_tanh(double x) { return tanh(x); }
__device__ __forceinline__ float fx_erf(float x) { return erff(x); }
__device__ __forceinline__ double fx_erf(double x) { return erf(x); }
__device__ __forceinline__ float fx_rsqrt(float x) { return rsqrtf(x); }
__device__ __forceinline__ double fx_rsqrt(double x) { return rsqrt(x); }
__device__ __forceinline__ float fx_power(float x, float y) { return powf(x, y); }
__device__ __forceinline__ double fx_power(double x, double y) { return pow(x, y); }

template <typename T>
__device__ __forceinline__ T fx_sigmoid(T x) { return T(1) / (T(1) + fx_exp(-x)); }
template <typename T>
__device__ __forceinline__ T fx_silu(T x) { return x * fx_sigmoid(x); }
// x / 2 * (1 + f) as one multiply and one fma.
template <typename T>
__device__ __forceinline__ T fx_gelu(T x) {
  const T half = T(0.5) * x;
  return fma(half, fx_erf(x * T(0.70710678118654752440)), half);
}
template <typename T>
__device__ __forceinline__ T fx_gelu_tanh(T x) {
  const T half = T(0.5) * x;
  const T inner = T(0.79788456080286535588) * fma(T(0.044715) * x, x * x, x);
  return fma(half, fx_tanh(inner), half);
}

// NaN propagates, as in numpy.maximum / minimum and torch.relu.
template <typename T>
__device__ __forceinline__ T fx_maximum(T a, T b) { return (a > b || a != a) ? a : b; }
template <typename T>
__device__ __forceinline__ T fx_minimum(T a, T b) { return (a < b || a != a) ? a : b; }
template <typename T>
__device__ __forceinline__ T fx_relu(T x) { return (x > T(0) || x != x) ? x : T(0); }
template <typename T>
__device__ __forceinline__ T fx_abs(T x) { return x < T(0) ? T(-x) : x; }
__device__ __forceinline__ float fx_abs(float x) { return fabsf(x); }
__device__ __forceinline__ double fx_abs(double x) { return fabs(x); }
__device__ __forceinline__ bool fx_abs(bool x) { return x; }

template <typename T>
__device__ __forceinline__ T fx_infinity() { return T(__longlong_as_double(0x7ff0000000000000ll)); }
template <typename T>
__device__ __forceinline__ T fx_nan() { return T(__longlong_as_double(0x7ff8000000000000ll)); }

// floor(p * 2^32), exact in double: the Philox word a kept element reaches
// (cupyops.philox.dropout_threshold on the host).
__device__ __forceinline__ unsigned fx_dropout_threshold(double p) {
  return static_cast<unsigned>(p * 4294967296.0);
}

// i / d and i % d. 32-bit indices: by a multiply-high and a shift, the divisor's
// magic number worked out on the host (d >= 2, i < 2^31); 64-bit: by division.
template <typename I>
struct Divider {
  long long d;
  __device__ __forceinline__ I div(I i) const { return i / d; }
  __device__ __forceinline__ I mod(I i) const { return i % d; }
};
template <>
struct Divider<int> {
  int d;
  unsigned multiplier;
  unsigned shift;
  __device__ __forceinline__ int div(int i) const {
    return static_cast<int>(__umulhi(static_cast<unsigned>(i), multiplier) >> shift);
  }
  __device__ __forceinline__ int mod(int i) const { return i - div(i) * d; }
};

// -- operands: element i of the output reads ... -------------------------------------------
// ... element i (the operand has the output's shape and layout).
template <typename T, int P, typename I, bool vector>
struct LinearOperand {
  const T* data;
  __device__ __forceinline__ Pack<T, P> pack(I first) const {
    if constexpr (vector) {
      return load_pack<T, P>(data + first);
    } else {
      Pack<T, P> out;
#pragma unroll
      for (int j = 0; j < P; ++j) out.elem[j] = data[first + j];
      return out;
    }
  }
  __device__ __forceinline__ T element(I i) const { return data[i]; }
};

// ... element i % inner: `inner` contiguous elements repeated over the leading
// axes (a per-column bias). vector: inner is a multiple of the pack.
template <typename T, int P, typename I, bool vector>
struct InnerOperand {
  const T* data;
  Divider<I> inner;
  __device__ __forceinline__ Pack<T, P> pack(I first) const {
    if constexpr (vector) {
      return load_pack<T, P>(data + inner.mod(first));
    } else {
      Pack<T, P> out;
#pragma unroll
      for (int j = 0; j < P; ++j) out.elem[j] = data[inner.mod(first + j)];
      return out;
    }
  }
  __device__ __forceinline__ T element(I i) const { return data[inner.mod(i)]; }
};

// ... element i / inner: one value for `inner` consecutive elements (a per-row
// scale). uniform: inner is a multiple of the pack, one load a pack.
template <typename T, int P, typename I, bool uniform>
struct OuterOperand {
  const T* data;
  Divider<I> inner;
  __device__ __forceinline__ Pack<T, P> pack(I first) const {
    Pack<T, P> out;
    if constexpr (uniform) {
      const T value = data[inner.div(first)];
#pragma unroll
      for (int j = 0; j < P; ++j) out.elem[j] = value;
    } else {
#pragma unroll
      for (int j = 0; j < P; ++j) out.elem[j] = data[inner.div(first + j)];
    }
    return out;
  }
  __device__ __forceinline__ T element(I i) const { return data[inner.div(i)]; }
};

// ... element 0 (a one-element array broadcast to every element).
template <typename T, int P, typename I>
struct ScalarOperand {
  const T* data;
  __device__ __forceinline__ Pack<T, P> pack(I) const {
    const T value = *data;
    Pack<T, P> out;
#pragma unroll
    for (int j = 0; j < P; ++j) out.elem[j] = value;
    return out;
  }
  __device__ __forceinline__ T element(I) const { return *data; }
};

// ... through its own strides over the output's (merged) axes: any view,
// transposed or broadcast in the middle.
template <typename T, int P, typename I, int D>
struct StridedOperand {
  const T* data;
  I sizes[D];
  I strides[D];
  __device__ __forceinline__ T element(I i) const {
    I offset = 0;
#pragma unroll
    for (int d = D - 1; d > 0; --d) {
      offset += (i % sizes[d]) * strides[d];
      i /= sizes[d];
    }
    return data[offset + i * strides[0]];
  }
  __device__ __forceinline__ Pack<T, P> pack(I first) const {
    Pack<T, P> out;
#pragma unroll
    for (int j = 0; j < P; ++j) out.elem[j] = element(first + j);
    return out;
  }
};

}  // namespace cupyops
