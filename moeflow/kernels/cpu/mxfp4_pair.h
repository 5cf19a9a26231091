/* The block-pair primitives of mxfp4.c (included by it alone): per build (AVX-512 VBMI two rows at once, AVX2,
   portable C) the decode of a pair of 16-byte blocks to |2 e2m1| and signs, e8_half of the scales, and the exact
   word sums times xs e8 added to a row's fp32 lanes; mxfp4.c's comment states the bit layout and the numerics. */
#ifndef MOEFLOW_CPU_MXFP4_PAIR_H
#define MOEFLOW_CPU_MXFP4_PAIR_H
#include <stdint.h>
#include <string.h>

#include "mxfp4.h"

static const int8_t VALUES[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};  /* 2 x e2m1 */

/* 2^(e - 128) as a float (e8m0 halved: the table holds doubled values), exactly, subnormal for e < 2. */
MXI float e8_half(uint8_t e) {
    const uint32_t bits = e >= 2 ? (uint32_t)(e - 1) << 23 : 0x200000u << e;
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

/* ---- one block pair ---------------------------------------------------------------------------------------- */

#if MF_AVX2
typedef __m256 lanes;
MXI lanes lanes_zero(void) { return _mm256_setzero_ps(); }
MXI lanes lanes_load(const float* p) { return _mm256_loadu_ps(p); }
MXI void lanes_store(float* p, lanes a) { _mm256_storeu_ps(p, a); }
MXI float lanes_sum(lanes a) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}
typedef struct { __m256i mag0, mag1, val0, val1; } decoded;

/* 32 bytes (blocks 2bp at lo, 2bp + 1 at hi) -> the codes' |2 e2m1| and 2 e2m1 in the two registers' orders. */
MXI decoded decode_w(__m256i w) {
    const __m256i m7 = _mm256_set1_epi16(7), m8 = _mm256_set1_epi16(8);
    const __m256i s6 = _mm256_srli_epi16(w, 6), s12 = _mm256_srli_epi16(w, 12);
    const __m256i c = _mm256_or_si256(_mm256_and_si256(w, m7), _mm256_and_si256(s6, m8));
    const __m256i b = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(w, 3), m7),
                                      _mm256_and_si256(_mm256_srli_epi16(w, 9), m8));
    const __m256i a = _mm256_or_si256(_mm256_and_si256(s6, m7), _mm256_and_si256(s12, m8));
    const __m256i d = _mm256_or_si256(
        _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(w, 10), _mm256_set1_epi16(1)),
                        _mm256_and_si256(s12, _mm256_set1_epi16(6))),
        _mm256_and_si256(_mm256_srli_epi16(w, 8), m8));
    const __m256i p0 = _mm256_or_si256(c, _mm256_slli_epi16(b, 8)), p1 = _mm256_or_si256(a, _mm256_slli_epi16(d, 8));
    const __m256i vt = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i*)VALUES));
    const __m256i mt = _mm256_abs_epi8(vt);
    decoded r = {_mm256_shuffle_epi8(mt, p0), _mm256_shuffle_epi8(mt, p1), _mm256_shuffle_epi8(vt, p0),
                 _mm256_shuffle_epi8(vt, p1)};
    return r;
}
MXI decoded decode(const uint8_t* lo, const uint8_t* hi) {
    return decode_w(_mm256_inserti128_si256(_mm256_castsi128_si256(_mm_loadu_si128((const __m128i*)lo)),
                                            _mm_loadu_si128((const __m128i*)hi), 1));
}

/* P = 64: rows r .. r + 3's 8 scale bytes (2bp, 2bp + 1 of each) -> e8_half of byte k in lane k (the same bits);
   row q's make_e(e8_half(2bp), e8_half(2bp + 1)) is then lanes (2q x4, 2q + 1 x4) (e8_of) */
MXI __m256 e8_half_rows4(const uint8_t* sc) {
    const __m256i e = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)sc));
    const __m256i big = _mm256_slli_epi32(_mm256_sub_epi32(e, _mm256_set1_epi32(1)), 23);
    const __m256i small = _mm256_sllv_epi32(_mm256_set1_epi32(0x200000), e);
    return _mm256_castsi256_ps(_mm256_blendv_epi8(small, big, _mm256_cmpgt_epi32(e, _mm256_set1_epi32(1))));
}
MXI lanes e8_of(__m256 f, int q) {
    return _mm256_permutevar8x32_ps(f, _mm256_add_epi32(_mm256_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1),
                                                        _mm256_set1_epi32(2 * q)));
}

/* lanes += (the 8 exact word sums of the decoded pair times the token's codes xp[0 .. 63]) * (xs8 * e8): xs8 the
   token's (xs0 x4, xs1 x4), e8 the blocks' (2^(e0 - 128) x4, 2^(e1 - 128) x4), multiplied in fp32 per lane. */
MXI lanes make_e(float f0, float f1) { return _mm256_set_m128(_mm_set1_ps(f1), _mm_set1_ps(f0)); }

MXI lanes pair_add(lanes acc, const decoded* w, const int8_t* xp, const float* xs8, lanes e8) {
    const __m256i x0 = _mm256_sign_epi8(_mm256_loadu_si256((const __m256i*)xp), w->val0);
    const __m256i x1 = _mm256_sign_epi8(_mm256_loadu_si256((const __m256i*)(xp + 32)), w->val1);
#if MF_AVX512
    const __m256i dot = _mm256_dpbusd_epi32(_mm256_dpbusd_epi32(_mm256_setzero_si256(), w->mag0, x0), w->mag1, x1);
#else
    const __m256i dot = _mm256_madd_epi16(_mm256_add_epi16(_mm256_maddubs_epi16(w->mag0, x0),
                                                           _mm256_maddubs_epi16(w->mag1, x1)),
                                          _mm256_set1_epi16(1));
#endif
    return _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_mul_ps(_mm256_loadu_ps(xs8), e8), acc);
}
#if MF_AVX512 && defined(__AVX512VBMI__) && defined(__AVX512BITALG__)
#define MX_PAIR2 1
/* Two rows' pairs in one 512-bit register (row A's blocks in the low half, row B's in the high: the same bytes and
   lanes as two decode() calls), the sign kept as a mask: x negated where the code's sign bit is set (|w| = 0 for
   -0, so the word sums are decode()'s, exactly). */
typedef struct { __m512i mag0, mag1; __mmask64 neg0, neg1; } decoded2;

MXI __m512i load4x16(const uint8_t* alo, const uint8_t* ahi, const uint8_t* blo, const uint8_t* bhi) {
    __m512i w = _mm512_castsi128_si512(_mm_loadu_si128((const __m128i*)alo));
    w = _mm512_inserti32x4(w, _mm_loadu_si128((const __m128i*)ahi), 1);
    w = _mm512_inserti32x4(w, _mm_loadu_si128((const __m128i*)blo), 2);
    return _mm512_inserti32x4(w, _mm_loadu_si128((const __m128i*)bhi), 3);
}

/* With VBMI and BITALG (Zen 4, Ice Lake and later): vpmultishiftqb gathers each code's bit field into a byte of
   its own, in decode()'s byte order (register 0: C lo, B lo, C hi, B hi of each word; register 1: A lo, D lo, A hi,
   D hi), vpermb maps fields to |2 e2m1| (bits of other codes in a field are ignored by the tables), and
   vpshufbitqmb gathers the sign bits into the masks: 7 instructions for 128 codes. */
static const uint8_t MS0[8] = {0, 3, 16, 19, 32, 35, 48, 51}, MS1[8] = {6, 10, 22, 26, 38, 42, 54, 58};
static const uint8_t SG0[8] = {9, 12, 25, 28, 41, 44, 57, 60}, SG1[8] = {15, 11, 31, 27, 47, 43, 63, 59};

MXI __m512i bcast8(const uint8_t* p) { uint64_t v; memcpy(&v, p, 8); return _mm512_set1_epi64((long long)v); }

/* field (6 bits) -> |2 e2m1|: T7 of a magnitude code in bits 0-2 (A, B, C), TD of D's (m at bit 0, e at 3-4) */
static const uint8_t T7[64] __attribute__((aligned(64))) = {
    0, 1, 2, 3, 4, 6, 8, 12, 0, 1, 2, 3, 4, 6, 8, 12, 0, 1, 2, 3, 4, 6, 8, 12, 0, 1, 2, 3, 4, 6, 8, 12, 0, 1, 2, 3,
    4, 6, 8, 12, 0, 1, 2, 3, 4, 6, 8, 12, 0, 1, 2, 3, 4, 6, 8, 12, 0, 1, 2, 3, 4, 6, 8, 12};
static const uint8_t TD[64] __attribute__((aligned(64))) = {
    0, 1, 0, 1, 0, 1, 0, 1, 2, 3, 2, 3, 2, 3, 2, 3, 4, 6, 4, 6, 4, 6, 4, 6, 8, 12, 8, 12, 8, 12, 8, 12, 0, 1, 0, 1,
    0, 1, 0, 1, 2, 3, 2, 3, 2, 3, 2, 3, 4, 6, 4, 6, 4, 6, 4, 6, 8, 12, 8, 12, 8, 12, 8, 12};

MXI decoded2 decode2(__m512i w) {
    const __m512i f0 = _mm512_multishift_epi64_epi8(bcast8(MS0), w);
    const __m512i f1 = _mm512_multishift_epi64_epi8(bcast8(MS1), w);
    const __m512i lut7 = _mm512_load_si512(T7), lutd = _mm512_load_si512(TD);
    decoded2 r = {_mm512_permutexvar_epi8(f0, lut7),
                  _mm512_mask_permutexvar_epi8(_mm512_permutexvar_epi8(f1, lut7), 0xAAAAAAAAAAAAAAAAull, f1, lutd),
                  _mm512_bitshuffle_epi64_mask(w, bcast8(SG0)), _mm512_bitshuffle_epi64_mask(w, bcast8(SG1))};
    return r;
}

/* e8_half of 4 scales (bytes of e4) each in 4 lanes, (0 1 2 3) -> lanes 0-3, 4-7, 8-11, 12-15; the same bits
   (e >= 2: (e - 1) << 23, else 0x200000 << e); lanes of bytes 1 and 3 zero when odd (no block 2bp + 1). */
MXI __m512i e8_bits16(__m512i e) {  /* 16 lanes of e (0 .. 255) -> the bits of e8_half(e) */
    const __m512i big = _mm512_slli_epi32(_mm512_sub_epi32(e, _mm512_set1_epi32(1)), 23);
    const __m512i small = _mm512_sllv_epi32(_mm512_set1_epi32(0x200000), e);
    return _mm512_mask_blend_epi32(_mm512_cmpge_epu32_mask(e, _mm512_set1_epi32(2)), small, big);
}
MXI __m512 e8_half16(uint32_t e4, int odd) {
    const __m128i idx = _mm_setr_epi8(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3);
    const __m512i bits = e8_bits16(_mm512_cvtepu8_epi32(_mm_shuffle_epi8(_mm_cvtsi32_si128((int)e4), idx)));
    return _mm512_castsi512_ps(_mm512_maskz_mov_epi32(odd ? 0x0F0F : 0xFFFF, bits));
}
/* P = 64: rows r .. r + 7's 16 scale bytes (2bp, 2bp + 1 of each row) -> e8_half of byte k in lane k; row pair j's
   e8_half16 is then lanes 4j + (l / 4) (e16_of) */
MXI __m512 e8_half_rows8(const uint8_t* sc) {
    return _mm512_castsi512_ps(e8_bits16(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)sc))));
}
MXI __m512 e16_of(__m512 f, int j) {
    const __m512i quad = _mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3);
    return _mm512_permutexvar_ps(_mm512_add_epi32(quad, _mm512_set1_epi32(4 * j)), f);
}

/* The 16 lanes of rows A and B (acc: A's 8 then B's) += word sums * (xs8 * e16), as pair_add per row. */
typedef struct { __m512i x0, x1; __m512 xs; } token2;  /* a token's pair codes and xs8, in both halves */

MXI token2 token_load2(const int8_t* xp, const float* xs8) {
    token2 t = {_mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i*)xp)),
                _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i*)(xp + 32))),
                _mm512_castpd_ps(_mm512_broadcast_f64x4(_mm256_castps_pd(_mm256_loadu_ps(xs8))))};
    return t;
}

MXI __m512 pair_dot2(const decoded2* w, const token2* t) {  /* the 16 exact word sums, as floats */
    const __m512i zero = _mm512_setzero_si512(), x0 = t->x0, x1 = t->x1;
    const __m512i s0 = _mm512_mask_sub_epi8(x0, w->neg0, zero, x0), s1 = _mm512_mask_sub_epi8(x1, w->neg1, zero, x1);
    return _mm512_cvtepi32_ps(_mm512_dpbusd_epi32(_mm512_dpbusd_epi32(zero, w->mag0, s0), w->mag1, s1));
}
MXI __m512 pair_add2(__m512 acc, const decoded2* w, const token2* t, __m512 e16) {
    return _mm512_fmadd_ps(pair_dot2(w, t), _mm512_mul_ps(t->xs, e16), acc);
}
#endif
#else
typedef struct { float v[8]; } lanes;
MXI lanes lanes_zero(void) { lanes a = {{0}}; return a; }
MXI lanes lanes_load(const float* p) { lanes a; memcpy(a.v, p, sizeof a.v); return a; }
MXI void lanes_store(float* p, lanes a) { memcpy(p, a.v, sizeof a.v); }
MXI float lanes_sum(lanes a) {
    float b[4];
    for (int l = 0; l < 4; l++) b[l] = a.v[l] + a.v[l + 4];
    return (b[0] + b[2]) + (b[1] + b[3]);
}
typedef struct { uint8_t p[64]; } decoded;  /* the 4-bit codes in the two registers' byte orders */

MXI decoded decode(const uint8_t* lo, const uint8_t* hi) {
    decoded r;
    for (int j = 0; j < 16; j++) {
        const uint8_t* src = j < 8 ? lo + 2 * j : hi + 2 * (j - 8);
        const unsigned h = src[0] | (unsigned)src[1] << 8;
        r.p[2 * j] = (h & 7) | ((h >> 6) & 8);                              /* C */
        r.p[2 * j + 1] = ((h >> 3) & 7) | ((h >> 9) & 8);                   /* B */
        r.p[32 + 2 * j] = ((h >> 6) & 7) | ((h >> 12) & 8);                 /* A */
        r.p[32 + 2 * j + 1] = ((h >> 10) & 1) | ((h >> 12) & 6) | ((h >> 8) & 8);  /* D */
    }
    return r;
}

MXI lanes make_e(float f0, float f1) { lanes e = {{f0, f0, f0, f0, f1, f1, f1, f1}}; return e; }

MXI lanes pair_add(lanes acc, const decoded* w, const int8_t* xp, const float* xs8, lanes e8) {
    for (int l = 0; l < 8; l++) {
        int s = 0;
        for (int i = 0; i < 4; i++)
            s += VALUES[w->p[4 * l + i]] * xp[4 * l + i] + VALUES[w->p[32 + 4 * l + i]] * xp[32 + 4 * l + i];
        acc.v[l] = fmaf((float)s, xs8[l] * e8.v[l], acc.v[l]);
    }
    return acc;
}
#endif
#endif
