// CPU emulation of the bfloat16 type's conversions (see cuda_runtime.h in this directory).
#pragma once
#include <cstdint>
#include <cstring>

struct __nv_bfloat16 {
  uint16_t bits;
};

inline float __bfloat162float(__nv_bfloat16 h) {
  const uint32_t f = static_cast<uint32_t>(h.bits) << 16;
  float out;
  std::memcpy(&out, &f, 4);
  return out;
}

inline __nv_bfloat16 __float2bfloat16_rn(float x) {
  uint32_t f;
  std::memcpy(&f, &x, 4);
  if ((f & 0x7FFFFFFFu) > 0x7F800000u) return __nv_bfloat16{static_cast<uint16_t>((f >> 16) | 0x40u)};
  f += 0x7FFFu + ((f >> 16) & 1u);  // round to nearest even
  return __nv_bfloat16{static_cast<uint16_t>(f >> 16)};
}
