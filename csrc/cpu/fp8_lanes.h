// FP8 codes of a run of one row in intrinsics: eight lanes (AVX2) or sixteen (AVX-512 F / BW), for the ops
// whose codes are fp8_code(clamp(x / d, -Q, Q)) with Q the format's max: FP8-block (d its block's scale)
// and MXFP8 E4M3 (d a power of two). gcc's vectorization of the element function spills its masks (the
// clamp's NaN-passing selects, the narrowing to bytes) to the stack, and in the AVX-512 build was slower
// than the AVX2 one. Included by kernels_impl.h (inside namespace quantlib::cpu::<isa>, after formats.h)
// where the ISA's file defines QL_HAS_AVX512 or QL_HAS_AVX2 (one of them).
//
// The same operations as the element functions, lane by lane: the IEEE division x / d, the clamp (min /
// max: a NaN lane is replaced at the end, so their NaN rule does not matter), the normal rounding on the
// bits, the subnormal steps by one fp32 addition (fp8_subnormal_steps), the sign (the clamp keeps it). A
// NaN lane's code is 0x7F (Fp8BlockOp) or 0x7F with the NaN's sign (fp8_code, MX). Same bits:
// tests/test_kernels/test_fp8_block_codes_lanes.py (every bf16 pattern, each compiled variant).

// Whether an op's codes take the lane loops, its FP8 format and its NaN code.
template <class O>
struct Fp8Lanes {
  static constexpr bool kYes = false;
};
template <class F>
struct Fp8Lanes<Fp8BlockOp<F>> {
  static constexpr bool kYes = true;
  static constexpr bool kNanSigned = false;
  using Format = F;
};
template <>
struct Fp8Lanes<MxOp<MxE4M3>> {
  static constexpr bool kYes = true;
  static constexpr bool kNanSigned = true;
  using Format = E4M3;
};

// An input type's loads into fp32 lanes (specialized below for the ISA).
template <class T>
struct Lanes {
  static constexpr bool kOk = false;  // F16: the generic loop
};

#if defined(QL_HAS_AVX512)
template <>
struct Lanes<F32> {
  static constexpr bool kOk = true;
  static QL_INLINE __m512 load(const float* x) { return _mm512_loadu_ps(x); }
};
template <>
struct Lanes<BF16> {
  static constexpr bool kOk = true;
  static QL_INLINE __m512 load(const uint16_t* x) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(x))), 16));
  }
};

template <class F, bool NAN_SIGNED>
QL_INLINE __m128i fp8_code16(__m512 x, __m512 d) {
  const __m512 y = _mm512_div_ps(x, d);
  const __mmask16 nan = _mm512_cmp_ps_mask(y, y, _CMP_UNORD_Q);
  const __m512 yc = _mm512_min_ps(_mm512_max_ps(y, _mm512_set1_ps(-F::kMax)), _mm512_set1_ps(F::kMax));
  const __m512i a = _mm512_and_si512(_mm512_castps_si512(yc), _mm512_set1_epi32(int(kAbsMask)));
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(a, F::kDrop), _mm512_set1_epi32(1));
  const __m512i up = _mm512_add_epi32(_mm512_add_epi32(a, _mm512_set1_epi32(int((1u << (F::kDrop - 1)) - 1u))), lsb);
  const __m512i normal = _mm512_sub_epi32(_mm512_srli_epi32(up, F::kDrop), _mm512_set1_epi32(int(F::kCodeBias)));
  const __m512i magic = _mm512_set1_epi32(int(uint32_t(F::kDrop + F::kMinf) << 23));
  const __m512i sub = _mm512_sub_epi32(_mm512_castps_si512(_mm512_add_ps(_mm512_castsi512_ps(a), _mm512_castsi512_ps(magic))), magic);
  const __mmask16 below = _mm512_cmpgt_epi32_mask(_mm512_set1_epi32(int(F::kMinNormalBits)), a);  // a < min normal
  const __m512i sign = _mm512_and_si512(_mm512_srli_epi32(_mm512_castps_si512(y), 24), _mm512_set1_epi32(0x80));
  const __m512i code = _mm512_mask_blend_epi32(below, normal, sub);
  const __m512i out = NAN_SIGNED ? _mm512_or_si512(_mm512_mask_blend_epi32(nan, code, _mm512_set1_epi32(0x7F)), sign)
                                 : _mm512_mask_blend_epi32(nan, _mm512_or_si512(code, sign), _mm512_set1_epi32(0x7F));
  return _mm512_cvtepi32_epi8(out);
}

// Codes of the first multiple of 32 of n elements with the run's d; returns how many were done.
template <class T, class F, bool NAN_SIGNED>
QL_INLINE int64_t fp8_codes32(const typename T::S* __restrict x, uint8_t* __restrict c, int64_t n, float d) {
  const __m512 dv = _mm512_set1_ps(d);
  int64_t k = 0;
  for (; k + 32 <= n; k += 32) {
    const __m128i c0 = fp8_code16<F, NAN_SIGNED>(Lanes<T>::load(x + k), dv);
    const __m128i c1 = fp8_code16<F, NAN_SIGNED>(Lanes<T>::load(x + k + 16), dv);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(c + k), c0);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(c + k + 16), c1);
  }
  return k;
}
#elif defined(QL_HAS_AVX2)
template <>
struct Lanes<F32> {
  static constexpr bool kOk = true;
  static QL_INLINE __m256 load(const float* x) { return _mm256_loadu_ps(x); }
};
template <>
struct Lanes<BF16> {
  static constexpr bool kOk = true;
  static QL_INLINE __m256 load(const uint16_t* x) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(x))), 16));
  }
};

template <class F, bool NAN_SIGNED>
QL_INLINE __m256i fp8_code8(__m256 x, __m256 d) {
  const __m256 y = _mm256_div_ps(x, d);
  const __m256 nan = _mm256_cmp_ps(y, y, _CMP_UNORD_Q);
  const __m256 yc = _mm256_min_ps(_mm256_max_ps(y, _mm256_set1_ps(-F::kMax)), _mm256_set1_ps(F::kMax));
  const __m256i a = _mm256_and_si256(_mm256_castps_si256(yc), _mm256_set1_epi32(int(kAbsMask)));
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(a, F::kDrop), _mm256_set1_epi32(1));
  const __m256i up = _mm256_add_epi32(_mm256_add_epi32(a, _mm256_set1_epi32(int((1u << (F::kDrop - 1)) - 1u))), lsb);
  const __m256i normal = _mm256_sub_epi32(_mm256_srli_epi32(up, F::kDrop), _mm256_set1_epi32(int(F::kCodeBias)));
  const __m256i magic = _mm256_set1_epi32(int(uint32_t(F::kDrop + F::kMinf) << 23));
  const __m256i sub = _mm256_sub_epi32(_mm256_castps_si256(_mm256_add_ps(_mm256_castsi256_ps(a), _mm256_castsi256_ps(magic))), magic);
  const __m256i below = _mm256_cmpgt_epi32(_mm256_set1_epi32(int(F::kMinNormalBits)), a);  // a < min normal (a < 2^31)
  const __m256i sign = _mm256_and_si256(_mm256_srli_epi32(_mm256_castps_si256(y), 24), _mm256_set1_epi32(0x80));
  const __m256i code = _mm256_blendv_epi8(normal, sub, below);
  const __m256i nan_i = _mm256_castps_si256(nan);
  return NAN_SIGNED ? _mm256_or_si256(_mm256_blendv_epi8(code, _mm256_set1_epi32(0x7F), nan_i), sign)
                    : _mm256_blendv_epi8(_mm256_or_si256(code, sign), _mm256_set1_epi32(0x7F), nan_i);
}

// Codes of the first multiple of 32 of n elements with the run's d; returns how many were done.
template <class T, class F, bool NAN_SIGNED>
QL_INLINE int64_t fp8_codes32(const typename T::S* __restrict x, uint8_t* __restrict c, int64_t n, float d) {
  const __m256 dv = _mm256_set1_ps(d);
  const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);  // the packs interleave 128-bit lanes
  int64_t k = 0;
  for (; k + 32 <= n; k += 32) {
    const __m256i c0 = fp8_code8<F, NAN_SIGNED>(Lanes<T>::load(x + k), dv), c1 = fp8_code8<F, NAN_SIGNED>(Lanes<T>::load(x + k + 8), dv);
    const __m256i c2 = fp8_code8<F, NAN_SIGNED>(Lanes<T>::load(x + k + 16), dv);
    const __m256i c3 = fp8_code8<F, NAN_SIGNED>(Lanes<T>::load(x + k + 24), dv);
    const __m256i bytes = _mm256_packus_epi16(_mm256_packus_epi32(c0, c1), _mm256_packus_epi32(c2, c3));  // codes < 256
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(c + k), _mm256_permutevar8x32_epi32(bytes, order));
  }
  return k;
}
#endif
