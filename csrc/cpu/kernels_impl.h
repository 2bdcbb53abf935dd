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

#if defined(QL_HAS_AVX2)
// FP8-block codes eight lanes at a time (AVX2 intrinsics): gcc's vectorization of the element function
// spills its masks (the clamp's NaN-passing selects, the narrowing to bytes) to the stack. The same
// operations as Fp8BlockOp::code, lane by lane: the IEEE division x / d, the clamp (min / max: a NaN lane
// is replaced by 0x7F at the end, so their NaN rule does not matter), the normal rounding on the bits and
// the subnormal steps by one fp32 addition (fp8_subnormal_steps), the sign. Same bits (tests/test_kernels).
template <class T>
struct Lanes8 {
  static constexpr bool kOk = false;  // F16: the generic loop
};
template <>
struct Lanes8<F32> {
  static constexpr bool kOk = true;
  static QL_INLINE __m256 load(const float* x) { return _mm256_loadu_ps(x); }
};
template <>
struct Lanes8<BF16> {
  static constexpr bool kOk = true;
  static QL_INLINE __m256 load(const uint16_t* x) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(x))), 16));
  }
};

template <class F>
QL_INLINE __m256i fp8_block_code8(__m256 x, __m256 d) {
  const __m256 y = _mm256_div_ps(x, d);
  const __m256 nan = _mm256_cmp_ps(y, y, _CMP_UNORD_Q);
  const __m256 yc = _mm256_min_ps(_mm256_max_ps(y, _mm256_set1_ps(-F::kMax)), _mm256_set1_ps(F::kMax));
  const __m256i u = _mm256_castps_si256(yc);
  const __m256i a = _mm256_and_si256(u, _mm256_set1_epi32(int(kAbsMask)));
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(a, F::kDrop), _mm256_set1_epi32(1));
  const __m256i up = _mm256_add_epi32(_mm256_add_epi32(a, _mm256_set1_epi32(int((1u << (F::kDrop - 1)) - 1u))), lsb);
  const __m256i normal = _mm256_sub_epi32(_mm256_srli_epi32(up, F::kDrop), _mm256_set1_epi32(int(F::kCodeBias)));
  const __m256i magic = _mm256_set1_epi32(int(uint32_t(F::kDrop + F::kMinf) << 23));
  const __m256i sub = _mm256_sub_epi32(_mm256_castps_si256(_mm256_add_ps(_mm256_castsi256_ps(a), _mm256_castsi256_ps(magic))), magic);
  const __m256i below = _mm256_cmpgt_epi32(_mm256_set1_epi32(int(F::kMinNormalBits)), a);  // a < min normal (a < 2^31)
  const __m256i sign = _mm256_and_si256(_mm256_srli_epi32(u, 24), _mm256_set1_epi32(0x80));
  const __m256i code = _mm256_or_si256(_mm256_blendv_epi8(normal, sub, below), sign);
  return _mm256_blendv_epi8(code, _mm256_set1_epi32(0x7F), _mm256_castps_si256(nan));
}

#if !defined(QL_HAS_AVX512)
// Codes of the first multiple of 32 of n elements with the block's d; returns how many were done.
template <class T, class F>
QL_INLINE int64_t fp8_block_codes32(const typename T::S* __restrict x, uint8_t* __restrict c, int64_t n, float d) {
  const __m256 dv = _mm256_set1_ps(d);
  const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);  // the packs interleave 128-bit lanes
  int64_t k = 0;
  for (; k + 32 <= n; k += 32) {
    const __m256i c0 = fp8_block_code8<F>(Lanes8<T>::load(x + k), dv), c1 = fp8_block_code8<F>(Lanes8<T>::load(x + k + 8), dv);
    const __m256i c2 = fp8_block_code8<F>(Lanes8<T>::load(x + k + 16), dv), c3 = fp8_block_code8<F>(Lanes8<T>::load(x + k + 24), dv);
    const __m256i bytes = _mm256_packus_epi16(_mm256_packus_epi32(c0, c1), _mm256_packus_epi32(c2, c3));  // codes < 256
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(c + k), _mm256_permutevar8x32_epi32(bytes, order));
  }
  return k;
}
#endif  // !QL_HAS_AVX512
#endif

#if defined(QL_HAS_AVX512)
// The same codes sixteen lanes at a time (AVX-512 F / BW): fp8_block_code8's operations, the selects on mask
// registers and the narrowing to bytes by one vpmovdb.
template <class T>
struct Lanes16 {
  static constexpr bool kOk = false;  // F16: the generic loop
};
template <>
struct Lanes16<F32> {
  static constexpr bool kOk = true;
  static QL_INLINE __m512 load(const float* x) { return _mm512_loadu_ps(x); }
};
template <>
struct Lanes16<BF16> {
  static constexpr bool kOk = true;
  static QL_INLINE __m512 load(const uint16_t* x) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(x))), 16));
  }
};

template <class F>
QL_INLINE __m128i fp8_block_code16(__m512 x, __m512 d) {
  const __m512 y = _mm512_div_ps(x, d);
  const __mmask16 nan = _mm512_cmp_ps_mask(y, y, _CMP_UNORD_Q);
  const __m512 yc = _mm512_min_ps(_mm512_max_ps(y, _mm512_set1_ps(-F::kMax)), _mm512_set1_ps(F::kMax));
  const __m512i u = _mm512_castps_si512(yc);
  const __m512i a = _mm512_and_si512(u, _mm512_set1_epi32(int(kAbsMask)));
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(a, F::kDrop), _mm512_set1_epi32(1));
  const __m512i up = _mm512_add_epi32(_mm512_add_epi32(a, _mm512_set1_epi32(int((1u << (F::kDrop - 1)) - 1u))), lsb);
  const __m512i normal = _mm512_sub_epi32(_mm512_srli_epi32(up, F::kDrop), _mm512_set1_epi32(int(F::kCodeBias)));
  const __m512i magic = _mm512_set1_epi32(int(uint32_t(F::kDrop + F::kMinf) << 23));
  const __m512i sub = _mm512_sub_epi32(_mm512_castps_si512(_mm512_add_ps(_mm512_castsi512_ps(a), _mm512_castsi512_ps(magic))), magic);
  const __mmask16 below = _mm512_cmpgt_epi32_mask(_mm512_set1_epi32(int(F::kMinNormalBits)), a);  // a < min normal
  const __m512i sign = _mm512_and_si512(_mm512_srli_epi32(u, 24), _mm512_set1_epi32(0x80));
  const __m512i code = _mm512_or_si512(_mm512_mask_blend_epi32(below, normal, sub), sign);
  return _mm512_cvtepi32_epi8(_mm512_mask_blend_epi32(nan, code, _mm512_set1_epi32(0x7F)));
}

// Codes of the first multiple of 32 of n elements with the block's d; returns how many were done.
template <class T, class F>
QL_INLINE int64_t fp8_block_codes32(const typename T::S* __restrict x, uint8_t* __restrict c, int64_t n, float d) {
  const __m512 dv = _mm512_set1_ps(d);
  int64_t k = 0;
  for (; k + 32 <= n; k += 32) {
    const __m128i c0 = fp8_block_code16<F>(Lanes16<T>::load(x + k), dv), c1 = fp8_block_code16<F>(Lanes16<T>::load(x + k + 16), dv);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(c + k), c0);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(c + k + 16), c1);
  }
  return k;
}
template <class T>
using FpLanes = Lanes16<T>;
#elif defined(QL_HAS_AVX2)
template <class T>
using FpLanes = Lanes8<T>;
#endif

// Whether an op is FP8-block (and its FP8 format): its codes take the AVX2 loop above where compiled.
template <class O>
struct Fp8Block {
  static constexpr bool kYes = false;
};
template <class F>
struct Fp8Block<Fp8BlockOp<F>> {
  static constexpr bool kYes = true;
  using Format = F;
};

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
#if defined(QL_HAS_AVX2)
    if constexpr (Fp8Block<O>::kYes && FpLanes<T>::kOk) {
      const int64_t k = fp8_block_codes32<T, typename Fp8Block<O>::Format>(x, c, n, p.p0);
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
