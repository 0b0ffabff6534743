// CPU emulation of the half type's conversions (see cuda_runtime.h in this directory).
#pragma once
#include <cstdint>
#include <cstring>

struct __half {
  uint16_t bits;
};

inline float __half2float(__half h) {
  const uint32_t sign = (h.bits & 0x8000u) << 16, exp = (h.bits >> 10) & 0x1F, man = h.bits & 0x3FF;
  uint32_t f;
  if (exp == 0x1F) {
    f = sign | 0x7F800000u | (man << 13);
  } else if (exp != 0) {
    f = sign | ((exp + 112) << 23) | (man << 13);
  } else if (man == 0) {
    f = sign;
  } else {  // subnormal half: normalise
    int e = -1;
    uint32_t m = man;
    do {
      ++e;
      m <<= 1;
    } while (!(m & 0x400));
    f = sign | ((112 - e) << 23) | ((m & 0x3FF) << 13);
  }
  float out;
  std::memcpy(&out, &f, 4);
  return out;
}

// Round to nearest even, overflow to inf, NaN kept.
inline __half __float2half_rn(float x) {
  uint32_t f;
  std::memcpy(&f, &x, 4);
  const uint32_t sign = (f >> 16) & 0x8000u;
  const uint32_t absf = f & 0x7FFFFFFFu;
  uint16_t h;
  if (absf >= 0x7F800000u) {
    h = static_cast<uint16_t>(sign | 0x7C00u | (absf > 0x7F800000u ? 0x200u : 0u));
  } else if (absf >= 0x477FF000u) {  // rounds to >= 65520: inf
    h = static_cast<uint16_t>(sign | 0x7C00u);
  } else if (absf < 0x38800000u) {  // below the smallest normal half: subnormal or zero
    const int shift = 113 - static_cast<int>(absf >> 23);
    if (shift > 12) {  // below 2^-25: rounds to zero (and keeps the shifts below 32)
      h = static_cast<uint16_t>(sign);
    } else {
      const uint32_t m = (absf & 0x7FFFFFu) | 0x800000u;
      const uint32_t r = m >> (shift + 13), rem = m & ((1u << (shift + 13)) - 1), half = 1u << (shift + 12);
      h = static_cast<uint16_t>(sign | (r + (rem > half || (rem == half && (r & 1)))));
    }
  } else {
    const uint32_t r = absf - 0x38000000u;  // rebias exponent 127 -> 15
    const uint32_t base = r >> 13, rem = r & 0x1FFFu;
    h = static_cast<uint16_t>(sign | (base + (rem > 0x1000u || (rem == 0x1000u && (base & 1)))));
  }
  return __half{h};
}
