// The fused HSV augmentation of a training image, without torch (the op is hsv_augment_kernel.cpp):
// per pixel OpenCV's 8-bit BGR->HSV (hue in [0, 180)), the 3 gain tables of the Python path
// (yolofast/data/augment.py hsv_luts), and OpenCV's 8-bit HSV->BGR back, written as RGB or BGR: the three
// passes of cvtColor + LUT + cvtColor in one, with the same output bytes (tested on all 2^24 colours).
//
// The arithmetic, as OpenCV 4.x/5.x computes it:
// - forward (integer): v = max, diff = v - min, s = (diff * sdiv[v] + 2^11) >> 12 with
//   sdiv[v] = round(255 * 2^12 / v), h = (num * hdiv[diff] + 2^11) >> 12 with hdiv[d] = round(180 * 2^12
//   / (6 d)) and num = g - b | b - r + 2 diff | r - g + 4 diff (max in r | g | b), + 180 when negative.
//   The two tables are computed per lane as float quotients 1044480 / v and 122880 / d rounded: IEEE
//   division is correctly rounded, and for every v, d in 1..255 this is the table value (no quotient lies
//   within float's error of a .5), so no gather is needed. Lanes with v or d = 0 multiply by 0 anyway.
// - back (float, its SIMD path): h6 = h' * (6/180), sector = floor(h6), f = h6 - sector, s' and v' / 255,
//   tab = {v, v (1 - s), v fma(-s, f, 1), v fma(-s, 1 - f, 1)} (the last two fused multiply-adds, as
//   OpenCV's AVX2/AVX-512 code does: without the fusion 1758 of the 180 x 256 x 256 HSV inputs differ by
//   1), each channel one of tab by the sector, * 255 and truncated. OpenCV's scalar code (the last
//   w % 64 pixels of each row of w, after its 64-pixel vector steps: none at w = 640 or 320, 32 at 608)
//   rounds instead: the op does the same there, so its output is OpenCV's for any size.
// No other multiply-add may be fused (h6 - sector would change): the build has no -ffast-math and the
// only products feeding a sum are the explicit fma calls; the exhaustive test checks each build.
//
// Blocks of kHsvBlock pixels go through 5 loops over small planar arrays that the compiler vectorises for
// the build's ISA: split into b, g, r planes, forward, the 3 table lookups, back, join. On AVX-512 VBMI the
// lookups are 64 bytes per 4 instructions (vpermi2b on the 256-byte tables held in registers) and the
// split/join 2 byte permutes per register, instead of 3 gathers per 16 pixels and the compiler's stride-3
// shuffles. 640x640 on one AMD EPYC Zen 4 core: 0.55 ms (with gathers 0.92 ms, with stride-3 loops
// 1.3 ms; OpenCV's three passes 1.64 ms); the x86-64-v3 (AVX2) build, scalar lookups: 1.1 ms.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>

#if defined(__AVX512VBMI__) && defined(__AVX512BW__)
#include <immintrin.h>
#define YOLOFAST_HSV_VBMI 1
#endif

namespace yolofast_hsv {

constexpr int kHsvBlock = 256;  // pixels per block: ~8 KB of int32 temporaries, in L1

// The per-image tables: lut (256, 3) uint8 = hue, sat, val gains (hue entries < 180, checked by the op).
struct Tables {
  alignas(64) uint8_t hue[256];
  alignas(64) uint8_t sat[256];
  alignas(64) uint8_t val[256];
};

inline void make_tables(Tables& t, const uint8_t* lut) {
  for (int i = 0; i < 256; ++i) {
    t.hue[i] = lut[3 * i];
    t.sat[i] = lut[3 * i + 1];
    t.val[i] = lut[3 * i + 2];
  }
}

// Planar b, g, r bytes of n pixels -> OpenCV's 8-bit (h, s, v).
inline void forward(const uint8_t* __restrict bp, const uint8_t* __restrict gp, const uint8_t* __restrict rp,
                    int n, uint8_t* __restrict ho, uint8_t* __restrict so, uint8_t* __restrict vo) {
  for (int i = 0; i < n; ++i) {
    const int b = bp[i], g = gp[i], r = rp[i];
    const int v = std::max(std::max(b, g), r), diff = v - std::min(std::min(b, g), r);
    const int sdiv = static_cast<int>(1044480.0f / static_cast<float>(v + (v == 0)) + 0.5f);
    const int hdiv = static_cast<int>(122880.0f / static_cast<float>(diff + (diff == 0)) + 0.5f);
    const int vr = -static_cast<int>(v == r), vg = -static_cast<int>(v == g);
    const int num = (vr & (g - b)) + (~vr & ((vg & (b - r + 2 * diff)) + (~vg & (r - g + 4 * diff))));
    int h = (num * hdiv + 2048) >> 12;
    h += (h >> 31) & 180;
    ho[i] = static_cast<uint8_t>(h);
    so[i] = static_cast<uint8_t>((diff * sdiv + 2048) >> 12);
    vo[i] = static_cast<uint8_t>(v);
  }
}

#ifdef YOLOFAST_HSV_VBMI
// 64 lookups in a 256-byte table held in 4 registers: two 128-entry permutes, picked by the index's bit 7.
inline __m512i lut256(__m512i idx, const __m512i* t) {
  const __m512i lo = _mm512_permutex2var_epi8(t[0], idx, t[1]);
  const __m512i hi = _mm512_permutex2var_epi8(t[2], idx, t[3]);
  return _mm512_mask_blend_epi8(_mm512_movepi8_mask(idx), lo, hi);
}
#endif

// x[i] = table[x[i]] for the three channels (n a multiple of 64 on the VBMI path: the block arrays are
// padded to kHsvBlock).
inline void lookup(const Tables& t, uint8_t* __restrict h, uint8_t* __restrict s, uint8_t* __restrict v, int n) {
#ifdef YOLOFAST_HSV_VBMI
  __m512i th[4], ts[4], tv[4];
  for (int k = 0; k < 4; ++k) {
    th[k] = _mm512_load_si512(t.hue + 64 * k);
    ts[k] = _mm512_load_si512(t.sat + 64 * k);
    tv[k] = _mm512_load_si512(t.val + 64 * k);
  }
  for (int i = 0; i < n; i += 64) {
    _mm512_storeu_si512(h + i, lut256(_mm512_loadu_si512(h + i), th));
    _mm512_storeu_si512(s + i, lut256(_mm512_loadu_si512(s + i), ts));
    _mm512_storeu_si512(v + i, lut256(_mm512_loadu_si512(v + i), tv));
  }
#else
  for (int i = 0; i < n; ++i) {
    h[i] = t.hue[h[i]];
    s[i] = t.sat[s[i]];
    v[i] = t.val[v[i]];
  }
#endif
}

// x * 255 -> byte: OpenCV's SIMD code truncates, its scalar code (the last w % 64 pixels of a row) rounds.
template <bool kRound>
inline int to_byte(float x) {
  return kRound ? static_cast<int>(std::nearbyint(x * 255.0f)) : static_cast<int>(x * 255.0f);
}

// (h', s', v') of n pixels -> OpenCV's 8-bit HSV->BGR, planar b, g, r bytes.
template <bool kRound>
inline void back(const uint8_t* __restrict h, const uint8_t* __restrict s, const uint8_t* __restrict v, int n,
                 uint8_t* __restrict bo, uint8_t* __restrict go, uint8_t* __restrict ro) {
  const float hscale = 6.0f / 180.0f, inv255 = 1.0f / 255.0f;
  for (int i = 0; i < n; ++i) {
    const float h6 = static_cast<float>(h[i]) * hscale;  // < 6: the hue tables are < 180
    const float ss = static_cast<float>(s[i]) * inv255, vv = static_cast<float>(v[i]) * inv255;
    const int k = static_cast<int>(h6);  // h6 >= 0: truncation is the floor
    const float f = h6 - static_cast<float>(k);
    const int q0 = to_byte<kRound>(vv);
    const int q1 = to_byte<kRound>(vv * (1.0f - ss));
    const int q2 = to_byte<kRound>(vv * std::fma(-ss, f, 1.0f));
    const int q3 = to_byte<kRound>(vv * std::fma(-ss, 1.0f - f, 1.0f));
    // OpenCV's sector table {b, g, r} in tab: {1,3,0} {1,0,2} {3,0,1} {0,2,1} {0,1,3} {2,1,0}. The four
    // bytes packed in one int; each channel shifts out the byte its column names (2 bits per sector in a
    // constant): no select chain (GCC if-converts none of these ternaries, the loop then stays scalar),
    // 0.60 -> 0.55 ms at 640x640 over 9 mask selects.
    const unsigned packed = static_cast<unsigned>(q0) | static_cast<unsigned>(q1) << 8 |
                            static_cast<unsigned>(q2) << 16 | static_cast<unsigned>(q3) << 24;
    const unsigned sh = 2u * static_cast<unsigned>(k);
    const int cb = static_cast<int>((packed >> (((0x835u >> sh) & 3u) * 8u)) & 255u);
    const int cg = static_cast<int>((packed >> (((0x583u >> sh) & 3u) * 8u)) & 255u);
    const int cr = static_cast<int>((packed >> (((0x358u >> sh) & 3u) * 8u)) & 255u);
    bo[i] = static_cast<uint8_t>(cb);
    go[i] = static_cast<uint8_t>(cg);
    ro[i] = static_cast<uint8_t>(cr);
  }
}

#ifdef YOLOFAST_HSV_VBMI
// Byte permutations that split 64 interleaved pixels (3 registers) into 3 planes and back: 2 permutes per
// register (a 2-register vpermt2b, then the lanes from the third register), instead of the compiler's
// shuffle sequences for stride-3 bytes (half of the kernel's time before).
struct Shuffles {
  alignas(64) uint8_t split_a[3][64], split_b[3][64], join_a[3][64], join_b[3][64];
  uint64_t split_mask[3], join_mask[3];
  Shuffles() {
    for (int c = 0; c < 3; ++c) {
      split_mask[c] = join_mask[c] = 0;
      for (int j = 0; j < 64; ++j) {
        const int p = 3 * j + c;  // plane c, lane j <- interleaved byte p
        split_a[c][j] = static_cast<uint8_t>(p & 127);
        split_b[c][j] = static_cast<uint8_t>((p - 128) & 63);
        if (p >= 128) split_mask[c] |= uint64_t{1} << j;
        const int q = 64 * c + j, px = q / 3, ch = q % 3;  // output register c, lane j <- plane ch, pixel px
        join_a[c][j] = static_cast<uint8_t>(px + (ch == 1 ? 64 : 0));
        join_b[c][j] = static_cast<uint8_t>(px);
        if (ch == 2) join_mask[c] |= uint64_t{1} << j;
      }
    }
  }
};

inline const Shuffles& shuffles() {
  static const Shuffles s;
  return s;
}

inline void split64(const uint8_t* src, uint8_t* p0, uint8_t* p1, uint8_t* p2, const Shuffles& sh) {
  const __m512i a0 = _mm512_loadu_si512(src), a1 = _mm512_loadu_si512(src + 64);
  const __m512i a2 = _mm512_loadu_si512(src + 128);
  uint8_t* planes[3] = {p0, p1, p2};
  for (int c = 0; c < 3; ++c) {
    __m512i t = _mm512_permutex2var_epi8(a0, _mm512_load_si512(sh.split_a[c]), a1);
    t = _mm512_mask_permutexvar_epi8(t, sh.split_mask[c], _mm512_load_si512(sh.split_b[c]), a2);
    _mm512_storeu_si512(planes[c], t);
  }
}

inline void join64(const uint8_t* p0, const uint8_t* p1, const uint8_t* p2, uint8_t* dst, const Shuffles& sh) {
  const __m512i x = _mm512_loadu_si512(p0), y = _mm512_loadu_si512(p1), z = _mm512_loadu_si512(p2);
  for (int c = 0; c < 3; ++c) {
    __m512i t = _mm512_permutex2var_epi8(x, _mm512_load_si512(sh.join_a[c]), y);
    t = _mm512_mask_permutexvar_epi8(t, sh.join_mask[c], _mm512_load_si512(sh.join_b[c]), z);
    _mm512_storeu_si512(dst + 64 * c, t);
  }
}
#endif

// Interleaved 3-byte pixels <-> 3 planes; n pixels (the VBMI path does whole groups of 64, then the rest).
inline void split(const uint8_t* __restrict src, int n, uint8_t* __restrict p0, uint8_t* __restrict p1,
                  uint8_t* __restrict p2) {
  int i = 0;
#ifdef YOLOFAST_HSV_VBMI
  const Shuffles& sh = shuffles();
  for (; i + 64 <= n; i += 64) split64(src + 3 * i, p0 + i, p1 + i, p2 + i, sh);
#endif
  for (; i < n; ++i) {
    p0[i] = src[3 * i];
    p1[i] = src[3 * i + 1];
    p2[i] = src[3 * i + 2];
  }
}

inline void join(const uint8_t* __restrict p0, const uint8_t* __restrict p1, const uint8_t* __restrict p2, int n,
                 uint8_t* __restrict dst) {
  int i = 0;
#ifdef YOLOFAST_HSV_VBMI
  const Shuffles& sh = shuffles();
  for (; i + 64 <= n; i += 64) join64(p0 + i, p1 + i, p2 + i, dst + 3 * i, sh);
#endif
  for (; i < n; ++i) {
    dst[3 * i] = p0[i];
    dst[3 * i + 1] = p1[i];
    dst[3 * i + 2] = p2[i];
  }
}

// n pixels of BGR src -> dst (RGB when rgb, else BGR); dst is src or does not overlap it (each block is read
// whole into the planes before its bytes are written). round: the products are rounded to bytes, as
// OpenCV's scalar code does for the w % 64 pixels at the end of each row.
inline void hsv_augment_run(const uint8_t* src, uint8_t* dst, int64_t n, const Tables& t, bool rgb,
                            bool round = false) {
  alignas(64) uint8_t b[kHsvBlock] = {}, g[kHsvBlock] = {}, r[kHsvBlock] = {};
  alignas(64) uint8_t h[kHsvBlock] = {}, s[kHsvBlock] = {}, v[kHsvBlock] = {};
  for (int64_t i0 = 0; i0 < n; i0 += kHsvBlock) {
    const int m = static_cast<int>(std::min<int64_t>(kHsvBlock, n - i0));
    split(src + 3 * i0, m, b, g, r);
    forward(b, g, r, m, h, s, v);
    lookup(t, h, s, v, (m + 63) & ~63);  // the padding lanes hold stale bytes; their results are unused
    if (round)
      back<true>(h, s, v, m, b, g, r);
    else
      back<false>(h, s, v, m, b, g, r);
    if (rgb)
      join(r, g, b, m, dst + 3 * i0);
    else
      join(b, g, r, m, dst + 3 * i0);
  }
}

}  // namespace yolofast_hsv
