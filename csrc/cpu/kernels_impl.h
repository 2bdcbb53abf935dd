// The raw CPU kernels: one pass per block (amax, scale, cast or fake quant). Compiled once per
// instruction set: kernels_<isa>.cpp includes this file inside namespace quantlib::cpu::<isa> under a
// `#pragma GCC target`, after <cstdint> and kernel_api.h, and defines QL_ISA_NAME. The element loops
// are plain, branch-free loops for the compiler to vectorize; no fast-math, no FMA contraction
// (-ffp-contract=off), so every fp32 operation rounds exactly as torch's does.

#include "numerics.h"
#include "formats.h"

// ---------------------------------------------------------------------------- storage types

struct F32 {
  using S = float;
  static QL_INLINE float load(float v) { return v; }
  static QL_INLINE float store(float v) { return v; }
  static QL_INLINE uint32_t abs_bits(float v) { return f2u(v) & kAbsMask; }  // orders |v|, NaN above Inf
  static QL_INLINE float abs_value(uint32_t bits) { return u2f(bits); }
};

struct BF16 {
  using S = uint16_t;
  static QL_INLINE float load(uint16_t v) { return bf16_to_float(v); }
  static QL_INLINE uint16_t store(float v) { return float_to_bf16(v); }
  static QL_INLINE uint32_t abs_bits(uint16_t v) { return v & 0x7FFFu; }
  static QL_INLINE float abs_value(uint32_t bits) { return bf16_to_float(uint16_t(bits)); }
};

struct F16 {
  using S = uint16_t;
  static QL_INLINE float load(uint16_t v) { return half_to_float(v); }
  static QL_INLINE uint16_t store(float v) { return float_to_half(v); }
  static QL_INLINE uint32_t abs_bits(uint16_t v) { return v & 0x7FFFu; }
  static QL_INLINE float abs_value(uint32_t bits) { return half_to_float(uint16_t(bits)); }
};

// ---------------------------------------------------------------------------- runs of one row
// N > 0: the run length known at compile time (full blocks of 16 / 32); N == 0: n at run time.

template <class T, int N>
QL_INLINE uint32_t run_amax_bits(const typename T::S* __restrict x, int64_t n_rt) {
  const int64_t n = N > 0 ? N : n_rt;
  uint32_t m = 0;
  for (int64_t k = 0; k < n; ++k) {
    const uint32_t v = T::abs_bits(x[k]);
    m = v > m ? v : m;
  }
  return m;
}

template <class T, class O, int N>
QL_INLINE void run_fake(const typename T::S* __restrict x, typename T::S* __restrict y, int64_t n_rt, const O& op, float p0, float p1) {
  const int64_t n = N > 0 ? N : n_rt;
  for (int64_t k = 0; k < n; ++k) y[k] = T::store(op.fake(T::load(x[k]), p0, p1));
}

template <class T, class O, int N>
QL_INLINE void run_fp8_codes(const typename T::S* __restrict x, uint8_t* __restrict c, int64_t n_rt, const O& op, float p0, float p1) {
  const int64_t n = N > 0 ? N : n_rt;
  for (int64_t k = 0; k < n; ++k) c[k] = uint8_t(op.code(T::load(x[k]), p0, p1));
}

#include "fp8_lanes.h"

// E2M1 codes as 32-bit lanes (so that the code loop vectorizes at the width of the fp32 inputs).
template <class T, class O, int N>
QL_INLINE void run_codes32(const typename T::S* __restrict x, uint32_t* __restrict c, int64_t n_rt, const O& op, float p0, float p1) {
  const int64_t n = N > 0 ? N : n_rt;
  for (int64_t k = 0; k < n; ++k) c[k] = op.code(T::load(x[k]), p0, p1);
}

// Bytes of code pairs: code 2k in the low nibble, 2k + 1 in the high one; codes[2 * pairs - 1] must exist.
QL_INLINE void pack_nibbles(const uint32_t* __restrict codes, uint8_t* __restrict out, int64_t pairs) {
  for (int64_t k = 0; k < pairs; ++k) {
    uint64_t pair;  // little endian: code 2k in the low 32 bits; each code < 16
    __builtin_memcpy(&pair, codes + 2 * k, 8);
    out[k] = uint8_t(pair | (pair >> 28));
  }
}

// Two E2M1 codes per byte, the even element in the low nibble; an odd run ends with a lone low nibble.
template <class T, class O, int N>
QL_INLINE void run_e2m1_packed(const typename T::S* __restrict x, uint8_t* __restrict c, int64_t n_rt, const O& op, float p0, float p1) {
  const int64_t n = N > 0 ? N : n_rt;
  constexpr int64_t kChunk = N > 0 && N < 256 ? N : 256;
  for (int64_t k0 = 0; k0 < n; k0 += kChunk) {
    const int64_t m = n - k0 < kChunk ? n - k0 : kChunk;
    alignas(64) uint32_t codes[kChunk + 2];
    run_codes32<T, O, (N > 0 && N < 256 ? N : 0)>(x + k0, codes, m, op, p0, p1);
    codes[m] = 0;
    pack_nibbles(codes, c + k0 / 2, (m + 1) / 2);
  }
}

template <class T>
QL_INLINE uint32_t row_amax_bits(const typename T::S* x, int64_t n) {
  if (n == 16) return run_amax_bits<T, 16>(x, n);
  if (n == 32) return run_amax_bits<T, 32>(x, n);
  return run_amax_bits<T, 0>(x, n);
}

template <class T, class O, Mode MODE>
QL_INLINE void row_apply(const BlockTask& t, const O& op, const BlockParams& p, int64_t row, int64_t c0, int64_t n) {
  using S = typename T::S;
  const S* x = static_cast<const S*>(t.x) + row * t.K + c0;
  if constexpr (MODE == Mode::FAKE) {
    S* y = static_cast<S*>(t.out) + row * t.K + c0;
    if (n == 16) return run_fake<T, O, 16>(x, y, n, op, p.p0, p.p1);
    if (n == 32) return run_fake<T, O, 32>(x, y, n, op, p.p0, p.p1);
    return run_fake<T, O, 0>(x, y, n, op, p.p0, p.p1);
  } else if constexpr (O::kCodes == Codes::FP8) {
    uint8_t* c = t.codes + row * t.K + c0;
#if defined(QL_HAS_AVX2) || defined(QL_HAS_AVX512)
    if constexpr (Fp8Lanes<O>::kYes && Lanes<T>::kOk) {
      const int64_t k = fp8_codes32<T, typename Fp8Lanes<O>::Format, Fp8Lanes<O>::kNanSigned>(x, c, n, p.p0);
      if (k == n) return;
      return run_fp8_codes<T, O, 0>(x + k, c + k, n - k, op, p.p0, p.p1);
    }
#endif
    if (n == 16) return run_fp8_codes<T, O, 16>(x, c, n, op, p.p0, p.p1);
    if (n == 32) return run_fp8_codes<T, O, 32>(x, c, n, op, p.p0, p.p1);
    return run_fp8_codes<T, O, 0>(x, c, n, op, p.p0, p.p1);
  } else if constexpr (O::kCodes == Codes::E2M1) {
    uint8_t* c = t.codes + row * ((t.K + 1) / 2) + c0 / 2;  // c0 is even: packed casts have even blocks
    if (n == 16) return run_e2m1_packed<T, O, 16>(x, c, n, op, p.p0, p.p1);
    if (n == 32) return run_e2m1_packed<T, O, 32>(x, c, n, op, p.p0, p.p1);
    return run_e2m1_packed<T, O, 0>(x, c, n, op, p.p0, p.p1);
  }
}

// ---------------------------------------------------------------------------- engines

// 2-D blocks (BM > 1): one block at a time, amax over its rows, then each row.
template <class T, class O, Mode MODE>
void run_blocks_2d(const BlockTask& t, const O& op, int64_t b0, int64_t b1) {
  const bool scan = t.amax_in == nullptr || t.nan_groups;
  int64_t j = b0 % t.kb, i = (b0 / t.kb) % t.mb, l = b0 / (t.kb * t.mb);
  for (int64_t b = b0; b < b1; ++b) {
    const int64_t r0 = l * t.M + i * t.BM;
    const int64_t rows = (t.M - i * t.BM) < t.BM ? (t.M - i * t.BM) : t.BM;
    const int64_t c0 = j * t.BK;
    const int64_t n = (t.K - c0) < t.BK ? (t.K - c0) : t.BK;
    uint32_t bits = 0;
    if (scan) {
      const typename T::S* x = static_cast<const typename T::S*>(t.x) + r0 * t.K + c0;
      for (int64_t r = 0; r < rows; ++r) {
        const uint32_t m = row_amax_bits<T>(x + r * t.K, n);
        bits = m > bits ? m : bits;
      }
    }
    const float a = t.amax_in != nullptr ? t.amax_in[b] : T::abs_value(bits);
    if (t.amax_out != nullptr) t.amax_out[b] = a;
    if constexpr (MODE != Mode::AMAX_ONLY) {
      BlockParams p = op.block(a);
      if (t.amax_in != nullptr && t.nan_groups && isnan_(T::abs_value(bits))) p.p0 = p.scale = u2f(kQuietNaN);
      if (t.scale_out != nullptr) t.scale_out[b] = p.scale;
      if (t.byte_out != nullptr) t.byte_out[b] = p.byte;
      for (int64_t r = 0; r < rows; ++r) row_apply<T, O, MODE>(t, op, p, r0 + r, c0, n);
    }
    if (++j == t.kb) {
      j = 0;
      if (++i == t.mb) {
        i = 0;
        ++l;
      }
    }
  }
}

// The op of one row: NVFP4 with a global scale per row (stacked experts) takes that row's; others the call's.
template <class O>
QL_INLINE const O& row_op(const BlockTask&, const O& op, int64_t, O&) {
  return op;
}

QL_INLINE const Nvfp4Op& row_op(const BlockTask& t, const Nvfp4Op& op, int64_t row, Nvfp4Op& own) {
  if (t.s2_rows == nullptr) return op;
  Ctx c = t.ctx;
  c.s2 = t.s2_rows[row];
  c.six_s2 = 6.0f * c.s2;  // as the wrapper's nvfp4_ctx
  own = Nvfp4Op(c);
  return own;
}

// 1-D blocks (BM = 1): up to kGroup consecutive blocks of one row at a time: their amax, then their
// parameters in one (vectorized) loop, then their elements.
template <class T, class O, Mode MODE>
void run_blocks_1d(const BlockTask& t, const O& call_op, int64_t b0, int64_t b1) {
  constexpr int64_t kGroup = 64, kSmallBlock = 32;
  using S = typename T::S;
  const bool scan = t.amax_in == nullptr || t.nan_groups;
  alignas(64) float a[kGroup], p0[kGroup], p1[kGroup], scale[kGroup];
  alignas(64) uint8_t byte[kGroup];
  alignas(64) uint32_t bits[kGroup];
  for (int64_t b = b0; b < b1;) {
    const int64_t row = b / t.kb, j0 = b % t.kb;
    O own = call_op;
    const O& op = row_op(t, call_op, row, own);
    const int64_t g = (t.kb - j0) < kGroup ? (t.kb - j0) : kGroup;
    const int64_t nb = (b1 - b) < g ? (b1 - b) : g;
    const S* x = static_cast<const S*>(t.x) + row * t.K;
    const int64_t last = t.K - (j0 + nb - 1) * t.BK;  // elements of the group's last block (or more)
    if (scan) {
      for (int64_t q = 0; q < nb; ++q) {
        const int64_t n = q == nb - 1 ? (last < t.BK ? last : t.BK) : t.BK;
        bits[q] = row_amax_bits<T>(x + (j0 + q) * t.BK, n);
      }
    }
    if (t.amax_in != nullptr) {
      for (int64_t q = 0; q < nb; ++q) a[q] = t.amax_in[b + q];
    } else {
      for (int64_t q = 0; q < nb; ++q) a[q] = T::abs_value(bits[q]);
    }
    if (t.amax_out != nullptr) {
      for (int64_t q = 0; q < nb; ++q) t.amax_out[b + q] = a[q];
    }
    if constexpr (MODE != Mode::AMAX_ONLY) {
      for (int64_t q = 0; q < nb; ++q) {
        const BlockParams p = op.block(a[q]);
        p0[q] = p.p0;
        p1[q] = p.p1;
        scale[q] = p.scale;
        byte[q] = p.byte;
      }
      if (t.amax_in != nullptr && t.nan_groups) {
        for (int64_t q = 0; q < nb; ++q) {
          if (isnan_(T::abs_value(bits[q]))) p0[q] = scale[q] = u2f(kQuietNaN);
        }
      }
      if (t.scale_out != nullptr) {
        for (int64_t q = 0; q < nb; ++q) t.scale_out[b + q] = scale[q];
      }
      if (t.byte_out != nullptr) {
        for (int64_t q = 0; q < nb; ++q) t.byte_out[b + q] = byte[q];
      }
      const int64_t c0 = j0 * t.BK, n_all = (nb - 1) * t.BK + (last < t.BK ? last : t.BK);
      if constexpr (MODE == Mode::CODES && O::kCodes == Codes::E2M1) {
        if (t.BK <= kSmallBlock) {  // small blocks: all codes of the group, then one packing loop
          alignas(64) uint32_t codes[kGroup * kSmallBlock + 2];
          for (int64_t q = 0; q < nb; ++q) {
            const int64_t n = q == nb - 1 ? n_all - q * t.BK : t.BK, c = q * t.BK;
            if (n == 16) run_codes32<T, O, 16>(x + c0 + c, codes + c, n, op, p0[q], p1[q]);
            else if (n == 32) run_codes32<T, O, 32>(x + c0 + c, codes + c, n, op, p0[q], p1[q]);
            else run_codes32<T, O, 0>(x + c0 + c, codes + c, n, op, p0[q], p1[q]);
          }
          codes[n_all] = 0;
          pack_nibbles(codes, t.codes + row * ((t.K + 1) / 2) + c0 / 2, (n_all + 1) / 2);
          b += nb;
          continue;
        }
      }
      for (int64_t q = 0; q < nb; ++q) {
        BlockParams p;
        p.p0 = p0[q];
        p.p1 = p1[q];
        row_apply<T, O, MODE>(t, op, p, row, c0 + q * t.BK, q == nb - 1 ? n_all - q * t.BK : t.BK);
      }
    }
    b += nb;
  }
}

// c[k] = table[x[k]] for n 16-bit inputs: eight codes per 8-byte store (little endian, as pack_nibbles).
QL_INLINE void table_codes(const uint8_t* __restrict table, const uint16_t* __restrict x, uint8_t* __restrict c, int64_t n) {
  int64_t k = 0;
  for (; k + 8 <= n; k += 8) {
    uint64_t a, b;  // inputs k..k+3 and k+4..k+7, input k in the low 16 bits
    __builtin_memcpy(&a, x + k, 8);
    __builtin_memcpy(&b, x + k + 4, 8);
    uint64_t w = 0;
    for (int q = 0; q < 4; ++q) {
      w |= uint64_t(table[(a >> (16 * q)) & 0xFFFFu]) << (8 * q);
      w |= uint64_t(table[(b >> (16 * q)) & 0xFFFFu]) << (8 * q + 32);
    }
    __builtin_memcpy(c + k, &w, 8);
  }
  for (; k < n; ++k) c[k] = table[x[k]];
}

// FP8 codes of rows [b0, b1) of K elements with the given scale of each row (fp8_cast). With one scale
// for every row, 16-bit inputs take a table of the code of each of their 65536 values (built with the
// same element function, so the codes are the same bits) once the rows hold 4x as many elements: a byte
// load per element instead of the rounding arithmetic.
template <class T, class F>
void run_scaled_rows(const BlockTask& t, int64_t b0, int64_t b1) {
  using S = typename T::S;
  const Fp8Op<F> op(t.ctx);
  const S* x = static_cast<const S*>(t.x);
  if constexpr (sizeof(S) == 2) {
    constexpr int64_t kValues = int64_t(1) << 16;
    if (t.one_scale && (b1 - b0) * t.K >= 4 * kValues) {
      alignas(64) uint8_t table[kValues];
      const float s = t.scale_in[0];
      for (int64_t v = 0; v < kValues; ++v) table[v] = uint8_t(op.code(T::load(S(v)), s, 0.0f));
      table_codes(table, x + b0 * t.K, t.codes + b0 * t.K, (b1 - b0) * t.K);
      return;
    }
  }
  for (int64_t r = b0; r < b1; ++r) {
    run_fp8_codes<T, Fp8Op<F>, 0>(x + r * t.K, t.codes + r * t.K, t.K, op, t.scale_in[t.one_scale ? 0 : r], 0.0f);
  }
}

template <class T, class O, Mode MODE>
void run_blocks(const BlockTask& t, int64_t b0, int64_t b1) {
  const O op(t.ctx);
  if (t.BM == 1 && t.L == 1) return run_blocks_1d<T, O, MODE>(t, op, b0, b1);
  run_blocks_2d<T, O, MODE>(t, op, b0, b1);
}

template <class T, class O>
bool run_segment(const BcastTask& t, int64_t off, int64_t n, int64_t poff, int64_t pstride) {
  using S = typename T::S;
  const S* __restrict x = static_cast<const S*>(t.x) + off;
  S* __restrict y = static_cast<S*>(t.out) + off;
  const O op(t.ctx);
  if (pstride == 0) {
    run_fake<T, O, 0>(x, y, n, op, t.p0[poff], t.p1[poff]);
  } else if (pstride == 1) {
    const float* __restrict p0 = t.p0 + poff;
    const float* __restrict p1 = t.p1 + poff;
    for (int64_t k = 0; k < n; ++k) y[k] = T::store(op.fake(T::load(x[k]), p0[k], p1[k]));
  } else {
    for (int64_t k = 0; k < n; ++k) y[k] = T::store(op.fake(T::load(x[k]), t.p0[poff + k * pstride], t.p1[poff + k * pstride]));
  }
  return isnan_(T::abs_value(run_amax_bits<T, 0>(x, n)));
}

// ---------------------------------------------------------------------------- dispatch

template <class T>
void blocks_of(const BlockTask& t, int64_t b0, int64_t b1) {
  if (t.mode == Mode::AMAX_ONLY) return run_blocks<T, IntOp, Mode::AMAX_ONLY>(t, b0, b1);
  if (t.mode == Mode::FAKE) {
    switch (t.op) {
      case Op::INT: return run_blocks<T, IntOp, Mode::FAKE>(t, b0, b1);
      case Op::FP8_E4M3: return run_blocks<T, Fp8Op<E4M3>, Mode::FAKE>(t, b0, b1);
      case Op::FP8_E5M2: return run_blocks<T, Fp8Op<E5M2>, Mode::FAKE>(t, b0, b1);
      case Op::FP8BLK_E4M3: return run_blocks<T, Fp8BlockOp<E4M3>, Mode::FAKE>(t, b0, b1);
      case Op::FP8BLK_E5M2: return run_blocks<T, Fp8BlockOp<E5M2>, Mode::FAKE>(t, b0, b1);
      case Op::MX_E4M3: return run_blocks<T, MxOp<MxE4M3>, Mode::FAKE>(t, b0, b1);
      case Op::MX_E2M1: return run_blocks<T, MxOp<MxE2M1>, Mode::FAKE>(t, b0, b1);
      case Op::MX_E3M2: return run_blocks<T, MxOp<MxE3M2>, Mode::FAKE>(t, b0, b1);
      case Op::MX_E2M3: return run_blocks<T, MxOp<MxE2M3>, Mode::FAKE>(t, b0, b1);
      case Op::MX_INT8: return run_blocks<T, MxOp<MxInt8>, Mode::FAKE>(t, b0, b1);
      case Op::NVFP4: return run_blocks<T, Nvfp4Op, Mode::FAKE>(t, b0, b1);
      default: return;
    }
  }
  switch (t.op) {
    case Op::FP8_E4M3: return run_scaled_rows<T, E4M3>(t, b0, b1);
    case Op::FP8_E5M2: return run_scaled_rows<T, E5M2>(t, b0, b1);
    case Op::FP8BLK_E4M3: return run_blocks<T, Fp8BlockOp<E4M3>, Mode::CODES>(t, b0, b1);
    case Op::FP8BLK_E5M2: return run_blocks<T, Fp8BlockOp<E5M2>, Mode::CODES>(t, b0, b1);
    case Op::MX_E4M3: return run_blocks<T, MxOp<MxE4M3>, Mode::CODES>(t, b0, b1);
    case Op::MX_E2M1: return run_blocks<T, MxOp<MxE2M1>, Mode::CODES>(t, b0, b1);
    case Op::MX_E3M2: return run_blocks<T, MxOp<MxE3M2>, Mode::CODES>(t, b0, b1);
    case Op::MX_E2M3: return run_blocks<T, MxOp<MxE2M3>, Mode::CODES>(t, b0, b1);
    case Op::MX_INT8: return run_blocks<T, MxOp<MxInt8>, Mode::CODES>(t, b0, b1);
    case Op::NVFP4: return run_blocks<T, Nvfp4Op, Mode::CODES>(t, b0, b1);
    default: return;
  }
}

template <class T>
bool segment_of(const BcastTask& t, int64_t off, int64_t n, int64_t poff, int64_t pstride) {
  switch (t.op) {
    case Op::INT: return run_segment<T, IntOp>(t, off, n, poff, pstride);
    case Op::FP8_E4M3: return run_segment<T, Fp8Op<E4M3>>(t, off, n, poff, pstride);
    case Op::FP8_E5M2: return run_segment<T, Fp8Op<E5M2>>(t, off, n, poff, pstride);
    default: return false;
  }
}

void blocks(const BlockTask& t, int64_t b0, int64_t b1) {
  switch (t.dtype) {
    case DType::F32: return blocks_of<F32>(t, b0, b1);
    case DType::BF16: return blocks_of<BF16>(t, b0, b1);
    case DType::F16: return blocks_of<F16>(t, b0, b1);
  }
}

bool segment(const BcastTask& t, int64_t off, int64_t n, int64_t poff, int64_t pstride) {
  switch (t.dtype) {
    case DType::F32: return segment_of<F32>(t, off, n, poff, pstride);
    case DType::BF16: return segment_of<BF16>(t, off, n, poff, pstride);
    case DType::F16: return segment_of<F16>(t, off, n, poff, pstride);
  }
  return false;
}

const IsaKernels kKernels = {QL_ISA_NAME, &blocks, &segment};
