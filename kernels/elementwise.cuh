// Fused elementwise kernels: the math of cupyops.fx in float and double, and
// the ways an operand is read at the output's linear index (its broadcast).
#pragma once

#include "common.cuh"

namespace cupyops {

// -- math, one overload per compute type --------------------------------------------------
// `fast` (the kernel's float outputs are all 16-bit): exp and the activations built on it use
// the hardware exp2 and reciprocal, within a few float32 ulp of the value, relative: far below
// one 16-bit rounding. Functions without a `fast` argument are the same in both.
template <bool fast>
__device__ __forceinline__ float fx_exp(float x) { return fast ? __expf(x) : expf(x); }
template <bool fast>
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

// x / y for y >= 1 (or +inf); fast: the hardware reciprocal.
template <bool fast>
__device__ __forceinline__ float fx_ratio(float x, float y) { return fast ? __fdividef(x, y) : x / y; }
template <bool fast>
__device__ __forceinline__ double fx_ratio(double x, double y) { return x / y; }

template <bool fast, typename T>
__device__ __forceinline__ T fx_sigmoid(T x) { return fx_ratio<fast>(T(1), T(1) + fx_exp<fast>(-x)); }
template <bool fast, typename T>
__device__ __forceinline__ T fx_silu(T x) { return fx_ratio<fast>(x, T(1) + fx_exp<fast>(-x)); }

// Hardware approximations (flush-to-zero): 2^x and 1/x within 2 ulp.
__device__ __forceinline__ float fx_ex2_approx(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}
__device__ __forceinline__ float fx_rcp_approx(float x) {
  float y;
  asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

// erfc(z) / 2 = t * 2^(E(t) - z^2 log2(e)) for z >= 0, t = 1 / (1 + 0.675 z): E is a degree-6
// fit of log2(erfc(z) / 2t) + z^2 log2(e) over t in (0, 1], erfc within 8.8e-6 relative in
// exact arithmetic (tests/test_elementwise_cpu.py checks the fit against SciPy).
__device__ __forceinline__ float fx_half_erfc_log2_fit(float t) {
  float e = -0.3246130645275116f;
  e = fmaf(e, t, 1.1780164241790771f);
  e = fmaf(e, t, -1.3441349267959595f);
  e = fmaf(e, t, 0.07986085116863251f);
  e = fmaf(e, t, 0.359380304813385f);
  e = fmaf(e, t, 1.4442991018295288f);
  return fmaf(e, t, -2.392801284790039f);
}

// gelu(x) = x / 2 * (1 + erf(x / sqrt 2)); fast: x * (1 - h) for x >= 0, x * h below, with
// h = erfc(|x| / sqrt 2) / 2 from the fit above: relative-accurate where 1 + erf is tiny too.
template <bool fast, typename T>
__device__ __forceinline__ T fx_gelu(T x) {
  if constexpr (fast && sizeof(T) == sizeof(float)) {
    const float t = fx_rcp_approx(fmaf(fabsf(x), 0.47729707730092745f, 1.0f));   // 0.675 z = 0.675 |x| / sqrt 2
    const float h = t * fx_ex2_approx(fmaf(x * x, -0.72134752044448170368f, fx_half_erfc_log2_fit(t)));   // z^2 log2(e) = x^2 log2(e) / 2
    return x * (x >= 0.0f ? 1.0f - h : h);
  } else {
    const T half = T(0.5) * x;
    return fma(half, fx_erf(x * T(0.70710678118654752440)), half);
  }
}
// x / 2 * (1 + tanh(u)) = x * sigmoid(2u), u = sqrt(2 / pi) * (x + 0.044715 x^3): no
// cancellation where tanh(u) nears -1.
template <bool fast, typename T>
__device__ __forceinline__ T fx_gelu_tanh(T x) {
  const T u = T(0.79788456080286535588) * fma(T(0.044715) * x, x * x, x);
  return fx_ratio<fast>(x, T(1) + fx_exp<fast>(T(-2) * u));
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

// round(p * 2^16) (half to even), at most 2^16 - 1: the Philox half a kept element reaches
// (cupyops.philox.dropout_threshold on the host).
__device__ __forceinline__ unsigned fx_dropout_threshold(double p) {
  return static_cast<unsigned>(fmin(rint(p * 65536.0), 65535.0));
}

// i / d and i % d. 32-bit indices: by fast_quotient (common.cuh), the divisor's multiplier
// and shift worked out on the host; 64-bit: by division.
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
    return static_cast<int>(fast_quotient(static_cast<unsigned>(i), multiplier, shift));
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
