// Scalar fp32 math used by generated epilogue functors. The semantics match the reference
// backend (torch on fp32): NaN propagates through maximum/minimum like torch.maximum.
#pragma once

#include <cmath>
#include "cutlass/cutlass.h"
#include "cutlass/functional.h"
#include "cutlass/numeric_conversion.h"

namespace coda {

CUTLASS_HOST_DEVICE float maximum(float a, float b) { return (a != a || b != b) ? a + b : fmaxf(a, b); }
CUTLASS_HOST_DEVICE float minimum(float a, float b) { return (a != a || b != b) ? a + b : fminf(a, b); }
CUTLASS_HOST_DEVICE float relu(float x) { return x > 0.f ? x : (x != x ? x : 0.f); }
// The activations run once per output element, inside the epilogue that the cooperative kernel does
// not overlap with the mainloop: on the GPU they use the hardware approximations (ex2, rcp and tanh
// units; relative errors ~1e-6, and ~5e-4 for tanh inside GELU, far below bf16's 4e-3).
CUTLASS_HOST_DEVICE float fast_divide(float a, float b) {
#ifdef __CUDA_ARCH__
  return __fdividef(a, b);
#else
  return a / b;
#endif
}
// 2^x by the hardware, subnormal results flushed to 0: without .ftz (as __expf) a range fixup of three more
// instructions per value. A term below 2^-126 next to 1 (1 + e^-x; a sum holding a term of 1) changes nothing.
CUTLASS_DEVICE float exp2_ftz(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}
constexpr float kLog2e = 1.44269504088896341f;
CUTLASS_HOST_DEVICE float fast_exp(float x) {  // for sigmoid, silu and cd.logsumexp's terms
#ifdef __CUDA_ARCH__
  return exp2_ftz(x * kLog2e);
#else
  return expf(x);
#endif
}
CUTLASS_HOST_DEVICE float fast_tanh(float x) {
#ifdef __CUDA_ARCH__
  float y;
  asm("tanh.approx.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
#else
  return tanhf(x);
#endif
}
// sin/cos: RoPE angles (position x frequency) reach 1e5 radians, where sinf/cosf take a slow, stack-
// using path. Reduce to [-pi, pi] first (x - k*2pi in two fma steps, error ~2.4e-7 for |x| < 2^24),
// then use the hardware units (abs. error ~5e-7 on [-pi, pi]); non-finite x gives NaN, like sinf.
CUTLASS_HOST_DEVICE float reduce_angle(float x) {
  float k = rintf(x * 0.159154943091895336f);  // x / 2pi
  float r = fmaf(-k, 6.28318548202514648f, x);  // 2pi rounded up to fp32 ...
  return fmaf(-k, -1.74845553146951715e-7f, r);  // ... and the remainder 2pi - that
}
CUTLASS_HOST_DEVICE float fast_sin(float x) {
#ifdef __CUDA_ARCH__
  return __sinf(reduce_angle(x));
#else
  return sinf(x);
#endif
}
CUTLASS_HOST_DEVICE float fast_cos(float x) {
#ifdef __CUDA_ARCH__
  return __cosf(reduce_angle(x));
#else
  return cosf(x);
#endif
}
CUTLASS_HOST_DEVICE float sigmoid(float x) { return fast_divide(1.f, 1.f + fast_exp(-x)); }
CUTLASS_HOST_DEVICE float silu(float x) { return fast_divide(x, 1.f + fast_exp(-x)); }
CUTLASS_HOST_DEVICE float gelu_erf(float x) { return 0.5f * x * (1.f + erff(x * 0.70710678118654752f)); }
CUTLASS_HOST_DEVICE float gelu_tanh(float x) {  // 0.5 x (1 + tanh(k0 (x + 0.044715 x^3))) in 6 instructions, not 8
  constexpr float k0 = 0.7978845608028654f, k1 = 0.044715f * 0.7978845608028654f;  // sqrt(2/pi)
  float h = 0.5f * x;
  return fmaf(h, fast_tanh(x * fmaf(k1, x * x, k0)), h);
}

// cd.cast(x, dtype): round to a storable type and back, as the stored tensor would hold it.
template <class Element>
CUTLASS_HOST_DEVICE float round_to(float x) {
  return float(cutlass::NumericConverter<Element, float, cutlass::FloatRoundStyle::round_to_nearest>{}(x));
}

}  // namespace coda

// Reductions CUTLASS lacks: max / min / max |x| that keep NaN as one-parameter templates (as torch.amax
// does; cutlass::maximum<float> is fmaxf, which drops it), and float atomics that keep it too.
namespace coda {

template <class T>
using amax_reduce = cutlass::maximum_absolute_value_reduction<T, true>;
template <class T>
using maximum_nan = cutlass::maximum<T, true>;
template <class T>
using minimum_nan = cutlass::minimum<T, true>;

// Float atomic max / min through integer atomics: non-negative floats order like signed ints, negative
// ones in reverse as unsigned ints. A NaN is stored as the one pattern that wins both orders and stays
// (0x7fffffff for max, 0xffffffff for min), so the statistic is NaN as torch's is.
template <class T>
struct atomic_maximum {
  CUTLASS_DEVICE void operator()(T* ptr, T value) const { atomicMax(ptr, value); }
};
template <>
struct atomic_maximum<float> {
  CUTLASS_DEVICE void operator()(float* ptr, float value) const {
#if defined(__CUDA_ARCH__)
    if (value != value) value = __uint_as_float(0x7fffffffu);
    if (!::signbit(value)) atomicMax(reinterpret_cast<int*>(ptr), __float_as_int(value));
    else atomicMin(reinterpret_cast<unsigned int*>(ptr), __float_as_uint(value));
#endif
  }
};
template <class T>
struct atomic_minimum {
  CUTLASS_DEVICE void operator()(T* ptr, T value) const { atomicMin(ptr, value); }
};
template <>
struct atomic_minimum<float> {
  CUTLASS_DEVICE void operator()(float* ptr, float value) const {
#if defined(__CUDA_ARCH__)
    if (value != value) value = __uint_as_float(0xffffffffu);
    if (!::signbit(value)) atomicMin(reinterpret_cast<int*>(ptr), __float_as_int(value));
    else atomicMax(reinterpret_cast<unsigned int*>(ptr), __float_as_uint(value));
#endif
  }
};

}  // namespace coda

namespace cutlass {
template <class T>
struct is_atomic<coda::atomic_maximum<T>> : platform::true_type {};
template <class T>
struct is_atomic<coda::atomic_minimum<T>> : platform::true_type {};
}  // namespace cutlass
