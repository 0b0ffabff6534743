// The assigner's hot loop in explicit SIMD (at::vec::Vectorized<T>, ISA chosen in cpu_common.h): the cheap
// part of CIoU(gt, pred) -- iou, q = rho2 / c2 and the bound iou - q -- for Vec<T>::size() consecutive
// anchors of one candidate row at once (16 AVX-512 / 8 AVX2 / 4 NEON floats). Nearly all of a GT's
// candidates stop at that bound (most predictions do not overlap the GT), so this is where the time goes.
//
// Exactness: each lane performs the operations of Ciou's scalar constructor (tal_assign_geometry.h) in the
// same order, each one IEEE-rounded (add, sub, mul, div are exact-rounded in any ISA; contraction into FMA
// is off for this header, see below), and min/max are written as the selects std::min/std::max are, so a
// NaN coordinate picks the same operand as the scalar code. The lanes are independent: the result of an
// anchor does not depend on its neighbours, the vector width or the thread.
#pragma once

#include "cpu_common.h"
#include "tal_assign_geometry.h"

#include <cstdint>

#if defined(__clang__)
#pragma clang fp contract(off)
#elif defined(__GNUC__)
#pragma GCC optimize("fp-contract=off")
#endif

namespace yolofast {
namespace tal {

template <typename T>
using TVec = at::vec::Vectorized<T>;

// std::min(a, b) is (b < a) ? b : a and std::max(a, b) is (a < b) ? b : a: with a NaN they return a.
template <typename T>
inline TVec<T> std_min(const TVec<T>& a, const TVec<T>& b) {
  return TVec<T>::blendv(a, b, b < a);
}
template <typename T>
inline TVec<T> std_max(const TVec<T>& a, const TVec<T>& b) {
  return TVec<T>::blendv(a, b, a < b);
}

// The cheap CIoU part of n <= Vec<T>::size() consecutive predictions p[0..4n) (x1, y1, x2, y2 each) against
// GT g: iou, q, w2, h2 and `proper` per lane. Lanes >= n compute on zero boxes and are not used.
template <typename T>
struct CiouLanes {
  static constexpr int W = TVec<T>::size();
  alignas(64) T iou[W], q[W], w2[W], h2[W];
  alignas(64) T px2_ge[W], py2_ge[W];  // all-ones bit masks where px2 >= px1, py2 >= py1

  inline void compute(const GtTerms<T>& g, const T* p, int n, T eps) {
    using V = TVec<T>;
    // Transpose the n boxes (array of structures) into four coordinate vectors.
    alignas(64) T c[4][W];
    for (int l = 0; l < W; ++l)
      for (int j = 0; j < 4; ++j) c[j][l] = l < n ? p[4 * l + j] : T(0);
    const V px1 = V::loadu(c[0]), py1 = V::loadu(c[1]), px2 = V::loadu(c[2]), py2 = V::loadu(c[3]);
    const V zero(T(0)), ve(eps);
    const V ax1(g.b.x1), ay1(g.b.y1), ax2(g.b.x2), ay2(g.b.y2);
    const V vw2 = px2 - px1;
    const V vh2 = (py2 - py1) + ve;
    const V iw = std_max<T>(std_min<T>(ax2, px2) - std_max<T>(ax1, px1), zero);
    const V ih = std_max<T>(std_min<T>(ay2, py2) - std_max<T>(ay1, py1), zero);
    const V inter = iw * ih;
    const V uni = ((V(g.w * g.h) + vw2 * vh2) - inter) + ve;
    (inter / uni).store(iou);
    const V cw = std_max<T>(ax2, px2) - std_min<T>(ax1, px1);
    const V ch = std_max<T>(ay2, py2) - std_min<T>(ay1, py1);
    const V c2 = (cw * cw + ch * ch) + ve;
    const V dx = (px1 + px2) - V(g.b.x1 + g.b.x2);
    const V dy = (py1 + py2) - V(g.b.y1 + g.b.y2);
    const V rho2 = (dx * dx + dy * dy) / V(T(4));
    (rho2 / c2).store(q);
    vw2.store(w2);
    vh2.store(h2);
    (px2 >= px1).store(px2_ge);
    (py2 >= py1).store(py2_ge);
  }

  inline Ciou<T> lane(const GtTerms<T>& g, int l) const {
    // A comparison lane is all ones (a NaN bit pattern) when true and +0 when false.
    const bool proper = g.proper && px2_ge[l] != T(0) && py2_ge[l] != T(0);
    return Ciou<T>(iou[l], q[l], w2[l], h2[l], proper);
  }
};

}  // namespace tal
}  // namespace yolofast
