/* The K-quant blocks (Q4_K, Q5_K, Q6_K) decoded and multiplied by one token's int8 codes into 8 exact int32 lanes
   per ISA (AVX-512 VNNI, AVX2, portable C): gguf_k.c's building blocks, included by it alone. Numerics: gguf.c's
   comment. */
#ifndef MOEFLOW_CPU_GGUF_KBLOCK_H
#define MOEFLOW_CPU_GGUF_KBLOCK_H
#include <stdint.h>
#include <string.h>

#include "gguf.h"

/* ---- K-quant blocks ------------------------------------------------------------------------------------------- */

/* One token against a decoded block, as 8 int32 lanes (exact): lane l of isum sums sc * q * x over the codes
   p = 32 i + 4 l + c (i < 8, c < 4), lane l of imin is mn[2l] bsum[2l] + mn[2l + 1] bsum[2l + 1]: kdot4_512 and
   kdot6_512 on AVX-512 VNNI, kdot on AVX2 (pmaddwd's lanes) and in portable C. */
#if MF_AVX2
typedef __m256i lanes;
#else
typedef struct { int32_t v[8]; } lanes;
#endif

#if MF_AVX512
/* Q4_K / Q5_K on AVX-512 VNNI (session 16; 256-bit registers, which Zen 4 runs at the rate of 512-bit ones per
   byte): a block as 8 vectors of 32 codes, sub-block i (one 6-bit scale) in vector i, the codes in file order (no
   lane shuffles, no 16-bit scale spreading), one token's int32 lanes per sub-block by vpdpbusd (lane l: codes
   32 i + 4 l + c, c < 4: at most 4 * 31 * 127, an int16), then times the sub-block's scale by vpdpwssd against
   (scale, 0) word pairs in every lane: lane l += P_l * scale, exact. The same integer lanes as kdot's, so the same
   bits. Measured (Qwen3-30B-A3B shapes, one thread, median expert call): benchmarks/results/peers/s16/. Two rows
   per 512-bit register (row A's sub-block in the low half, B's in the high, their fp32 steps in one instruction)
   was tried: faster from the caches, 1.5-2x slower from memory (docs/cpu.md, "K-quant kernels"), not kept. */
typedef struct {
    __m256i q[8], mn;
    int32_t sc[8];
    float d, dmin;
} k4block;

/* bit k of each byte of h moved to bit 4 (the rest 0) */
INLINE __m256i bit_to4(__m256i h, int k) {
    const __m256i b4 = _mm256_set1_epi8(0x10);
    if (k < 4) return _mm256_and_si256(_mm256_slli_epi16(h, 4 - k), b4);
    if (k > 4) return _mm256_and_si256(_mm256_srli_epi16(h, k - 4), b4);
    return _mm256_and_si256(h, b4);
}

INLINE void decode_k4_512(int type, const uint8_t* w, k4block* kb) {
    uint64_t sc8, mn8;
    kb->d = h2f(w);
    kb->dmin = h2f(w + 2);
    k4_scales(w + 4, &sc8, &mn8);
    _mm256_storeu_si256((__m256i*)kb->sc, _mm256_cvtepu8_epi32(_mm_cvtsi64_si128((long long)sc8)));
    const __m128i m = _mm_cvtsi64_si128((long long)mn8);
    kb->mn = _mm256_cvtepu8_epi16(_mm_unpacklo_epi8(m, m));  /* each min for its two 16-groups */
    const __m256i m4 = _mm256_set1_epi8(0x0F);
    const uint8_t* qs = w + (type == GG_Q4_K ? 16 : 48);  /* chunk c: sub-block 2c low nibbles, 2c + 1 high */
    for (int c = 0; c < 4; c++) {
        const __m256i v = _mm256_loadu_si256((const __m256i*)(qs + 32 * c));
        kb->q[2 * c] = _mm256_and_si256(v, m4);
        kb->q[2 * c + 1] = _mm256_and_si256(_mm256_srli_epi16(v, 4), m4);
    }
    if (type == GG_Q5_K) {  /* bit i of qh[l]: bit 4 of code 32 i + l */
        const __m256i h = _mm256_loadu_si256((const __m256i*)(w + 16));
        for (int i = 0; i < 8; i++) kb->q[i] = _mm256_or_si256(kb->q[i], bit_to4(h, i));
    }
}

INLINE void kdot4_512(const k4block* kb, const int8_t* x, const int16_t* bsum, __m256i* isum, __m256i* imin) {
    __m256i a0 = _mm256_setzero_si256(), a1 = _mm256_setzero_si256();  /* two chains: exact integer adds */
    for (int i = 0; i < 8; i += 2) {
        const __m256i p0 = _mm256_dpbusd_epi32(_mm256_setzero_si256(), kb->q[i],
                                               _mm256_loadu_si256((const __m256i*)(x + 32 * i)));
        const __m256i p1 = _mm256_dpbusd_epi32(_mm256_setzero_si256(), kb->q[i + 1],
                                               _mm256_loadu_si256((const __m256i*)(x + 32 * i + 32)));
        a0 = _mm256_dpwssd_epi32(a0, p0, _mm256_set1_epi32(kb->sc[i]));
        a1 = _mm256_dpwssd_epi32(a1, p1, _mm256_set1_epi32(kb->sc[i + 1]));
    }
    *isum = _mm256_add_epi32(a0, a1);
    *imin = _mm256_madd_epi16(kb->mn, _mm256_loadu_si256((const __m256i*)bsum));
}
/* Q4_K on AVX-512 VNNI (session 18): kdot4_512's lanes with half its scale multiplies. A 32-byte chunk c holds
   sub-block 2c (low nibbles) and 2c + 1 (high); vpdpbusd gives P_lo (lane l: the 4 codes 64c + 4l + j times the
   activations) and, on the high nibbles left in place (v & 0xF0 = 16 q), 16 P_hi; both fit an int16 (|P| <= 4 * 15
   * 127), so (16 P_hi) << 12 = P_hi << 16 blended over P_lo's high word is the word pair (P_lo, P_hi) and one
   vpdpwssd against (sc[2c], sc[2c + 1]) adds sc[2c] P_lo + sc[2c + 1] P_hi to lane l: the same exact integers as
   kdot4_512, so the same bits; per block 8 vpdpbusd + 4 vpdpwssd where kdot4_512 takes 8 + 8, and one AND per high
   nibble in place of a shift and an AND. (Q5_K's fifth bit puts its codes past an int16 pair: it keeps kdot4_512.)
   A scale pair is a dword of the scales widened to words (sc2[c] = sc[2c] | sc[2c + 1] << 16). */
typedef struct {
    __m256i lo[4], hi[4], mn;
    int32_t sc2[4];
} q4kblock;  /* d and dmin: k4_dd */

INLINE void decode_q4k_512(const uint8_t* w, q4kblock* kb) {
    uint64_t sc8, mn8;
    k4_scales(w + 4, &sc8, &mn8);
    _mm_storeu_si128((__m128i*)kb->sc2, _mm_cvtepu8_epi16(_mm_cvtsi64_si128((long long)sc8)));
    const __m128i m = _mm_cvtsi64_si128((long long)mn8);
    kb->mn = _mm256_cvtepu8_epi16(_mm_unpacklo_epi8(m, m));  /* each min for its two 16-groups */
    const __m256i m4 = _mm256_set1_epi8(0x0F), m4h = _mm256_set1_epi8((char)0xF0);
    for (int c = 0; c < 4; c++) {
        const __m256i v = _mm256_loadu_si256((const __m256i*)(w + 16 + 32 * c));
        kb->lo[c] = _mm256_and_si256(v, m4);
        kb->hi[c] = _mm256_and_si256(v, m4h);
    }
}

INLINE void kdotq4k_512(const q4kblock* kb, const int8_t* x, const int16_t* bsum, __m256i* isum, __m256i* imin) {
    __m256i a0 = _mm256_setzero_si256(), a1 = _mm256_setzero_si256();  /* two chains: exact integer adds */
    for (int c = 0; c < 4; c++) {
        const __m256i p0 = _mm256_dpbusd_epi32(_mm256_setzero_si256(), kb->lo[c],
                                               _mm256_loadu_si256((const __m256i*)(x + 64 * c)));
        const __m256i p1 = _mm256_dpbusd_epi32(_mm256_setzero_si256(), kb->hi[c],
                                               _mm256_loadu_si256((const __m256i*)(x + 64 * c + 32)));
        const __m256i pk = _mm256_mask_blend_epi16(0xAAAA, p0, _mm256_slli_epi32(p1, 12));
        if (c % 2) a1 = _mm256_dpwssd_epi32(a1, pk, _mm256_set1_epi32(kb->sc2[c]));
        else a0 = _mm256_dpwssd_epi32(a0, pk, _mm256_set1_epi32(kb->sc2[c]));
    }
    *isum = _mm256_add_epi32(a0, a1);
    *imin = _mm256_madd_epi16(kb->mn, _mm256_loadu_si256((const __m256i*)bsum));
}

/* Q6_K on AVX-512 VNNI (session 17): a block as 4 vectors of 64 codes in file order (vector k: codes 64k ..
   64k + 63; its low 32 bytes the j = 0 / 2 quarter of ql's 64-byte half, its high 32 the j = 1 / 3 one, the two
   high bits from qh broadcast to both halves and shifted by a per-half count), one token's 16 int32 lanes per vector
   by vpdpbusd (lane L: codes 64k + 4L + c, c < 4, at most 4 * 63 * 127 = 32004, an int16), then times its group's
   scale (group 4k + L / 4): since session 18 vectors 2j and 2j + 1 as one int16 word pair per lane (P_2j's low word
   under P_2j+1 << 16) by one vpdpwssd against the pair of their groups' scales (one vpermw per pair), where session
   17 took a vpdpwssd per vector against (scale, 0): exact either way. Lanes L and L + 8 fold onto kdot's lane L % 8
   (the sub-blocks 2k and 2k + 1): the same integer lanes as kdot's, so the same bits. */
typedef struct {
    __m512i q[4], sc[2];  /* sc[j]: the word pairs of vectors 2j, 2j + 1 */
    __m256i mn;  /* int16 [16]: 32 * the 16-groups' scales */
    float d;
} k6block;

static const int16_t IDX6P[32] = {0, 4, 0, 4, 0, 4, 0, 4, 1, 5, 1, 5, 1, 5, 1, 5,
                                  2, 6, 2, 6, 2, 6, 2, 6, 3, 7, 3, 7, 3, 7, 3, 7};

INLINE void decode_k6_512(const uint8_t* w, k6block* kb) {
    const uint8_t *ql = w, *qh = w + 128;
    const __m128i s8 = _mm_loadu_si128((const __m128i*)(w + 192));
    kb->d = h2f(w + 208);
    kb->mn = _mm256_slli_epi16(_mm256_cvtepi8_epi16(s8), 5);
    const __m512i s16 = _mm512_castsi256_si512(_mm256_cvtepi8_epi16(s8));
    const __m512i i2 = _mm512_loadu_si512((const void*)IDX6P);
    for (int j = 0; j < 2; j++)  /* lane L of pair j: (scale of group 8j + L / 4, of group 8j + 4 + L / 4) */
        kb->sc[j] = _mm512_permutexvar_epi16(_mm512_add_epi16(i2, _mm512_set1_epi16((short)(8 * j))), s16);
    const __m512i m4 = _mm512_set1_epi8(0x0F), m30 = _mm512_set1_epi8(0x30);
    const __m512i c01 = _mm512_inserti64x4(_mm512_set1_epi16(4), _mm256_set1_epi16(2), 1);  /* j = 0: << 4, 1: << 2 */
    const __m512i c23 = _mm512_inserti64x4(_mm512_setzero_si512(), _mm256_set1_epi16(2), 1);  /* j = 2: >> 0, 3: >> 2 */
    for (int n = 0; n < 2; n++) {
        const __m512i l = _mm512_loadu_si512((const void*)(ql + 64 * n));
        const __m512i h = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i*)(qh + 32 * n)));
        /* code | (high bits at bits 4, 5): ternary logic a | (b & c) */
        kb->q[2 * n] = _mm512_ternarylogic_epi32(_mm512_and_si512(l, m4), _mm512_sllv_epi16(h, c01), m30, 0xF8);
        kb->q[2 * n + 1] = _mm512_ternarylogic_epi32(_mm512_and_si512(_mm512_srli_epi16(l, 4), m4),
                                                     _mm512_srlv_epi16(h, c23), m30, 0xF8);
    }
}

INLINE void kdot6_512(const k6block* kb, const int8_t* x, const int16_t* bsum, __m256i* isum, __m256i* imin) {
    __m512i a0 = _mm512_setzero_si512(), a1 = _mm512_setzero_si512();  /* two chains: exact integer adds */
    for (int j = 0; j < 2; j++) {
        const __m512i p0 = _mm512_dpbusd_epi32(_mm512_setzero_si512(), kb->q[2 * j],
                                               _mm512_loadu_si512((const void*)(x + 128 * j)));
        const __m512i p1 = _mm512_dpbusd_epi32(_mm512_setzero_si512(), kb->q[2 * j + 1],
                                               _mm512_loadu_si512((const void*)(x + 128 * j + 64)));
        const __m512i pk = _mm512_mask_blend_epi16(0xAAAAAAAAu, p0, _mm512_slli_epi32(p1, 16));
        if (j) a1 = _mm512_dpwssd_epi32(a1, pk, kb->sc[j]);
        else a0 = _mm512_dpwssd_epi32(a0, pk, kb->sc[j]);
    }
    const __m512i a = _mm512_add_epi32(a0, a1);
    *isum = _mm256_add_epi32(_mm512_castsi512_si256(a), _mm512_extracti64x4_epi64(a, 1));
    *imin = _mm256_madd_epi16(kb->mn, _mm256_loadu_si256((const __m256i*)bsum));
}
#else
/* A decoded block, in registers where the ISA allows (a tile of tokens reuses it): the 256 unsigned codes (Q6_K:
   value + 32), the scales widened to int16 lanes matching maddubs' pairs, per 16-group corrections mn. */
#if MF_AVX2
#define KV 8  /* vectors of 32 codes */
typedef __m256i kvec;
#endif
typedef struct {
#if MF_AVX2
    kvec q[KV], sc[KV];  /* sc: the scale of the codes of each int16 lane of maddubs(q, x) */
    __m256i mn;          /* int16 [16]: per 16-group, Q4/5_K the min of its 32-group, Q6_K 32 * its scale */
#else
    uint8_t q[QKK];
    int16_t sc[16], mn[16];  /* per 16-group */
#endif
    float d, dmin;
} kblock;

/* the scales (one per 32 codes, bytes of sc8) and the mins (mn8) of a Q4_K / Q5_K block into kb */
INLINE void k4_expand(kblock* kb, uint64_t sc8, uint64_t mn8) {
#if MF_AVX2
    const __m128i m = _mm_cvtsi64_si128((long long)mn8);
    kb->mn = _mm256_cvtepu8_epi16(_mm_unpacklo_epi8(m, m));  /* each min for its two 16-groups */
    const __m256i s8 = _mm256_broadcastsi128_si256(_mm_cvtsi64_si128((long long)sc8));
    for (int i = 0; i < KV; i++) kb->sc[i] = _mm256_shuffle_epi8(s8, _mm256_set1_epi16((short)(0x8000 | i)));
#else
    for (int g = 0; g < 16; g++) {
        kb->sc[g] = (int16_t)((sc8 >> (8 * (g / 2))) & 0xFF);
        kb->mn[g] = (int16_t)((mn8 >> (8 * (g / 2))) & 0xFF);
    }
#endif
}

INLINE void decode_q4k(const uint8_t* w, kblock* kb) {
    uint64_t sc8, mn8;
    kb->d = h2f(w);
    kb->dmin = h2f(w + 2);
    k4_scales(w + 4, &sc8, &mn8);
    k4_expand(kb, sc8, mn8);
    const uint8_t* qs = w + 16;  /* 64-code chunk c: bytes 32c .. 32c + 31, low nibbles then high */
#if MF_AVX2
    const __m256i m4 = _mm256_set1_epi8(0x0F);
    for (int c = 0; c < 4; c++) {
        const __m256i v = _mm256_loadu_si256((const __m256i*)(qs + 32 * c));
        kb->q[2 * c] = _mm256_and_si256(v, m4);
        kb->q[2 * c + 1] = _mm256_and_si256(_mm256_srli_epi16(v, 4), m4);
    }
#else
    for (int c = 0; c < 4; c++)
        for (int l = 0; l < 32; l++) {
            kb->q[64 * c + l] = qs[32 * c + l] & 15;
            kb->q[64 * c + 32 + l] = qs[32 * c + l] >> 4;
        }
#endif
}

INLINE void decode_q5k(const uint8_t* w, kblock* kb) {
    uint64_t sc8, mn8;
    kb->d = h2f(w);
    kb->dmin = h2f(w + 2);
    k4_scales(w + 4, &sc8, &mn8);
    k4_expand(kb, sc8, mn8);
    const uint8_t *qh = w + 16, *qs = w + 48;  /* bit 2c of qh[l]: bit 4 of code 64c + l; bit 2c + 1: of 64c + 32 + l */
#if MF_AVX2
    const __m256i m4 = _mm256_set1_epi8(0x0F), one = _mm256_set1_epi8(1);
    const __m256i h = _mm256_loadu_si256((const __m256i*)qh);
    for (int c = 0; c < 4; c++) {
        const __m256i v = _mm256_loadu_si256((const __m256i*)(qs + 32 * c));
        const __m256i h0 = _mm256_and_si256(_mm256_srl_epi16(h, _mm_cvtsi32_si128(2 * c)), one);
        const __m256i h1 = _mm256_and_si256(_mm256_srl_epi16(h, _mm_cvtsi32_si128(2 * c + 1)), one);
        kb->q[2 * c] = _mm256_or_si256(_mm256_and_si256(v, m4), _mm256_slli_epi16(h0, 4));
        kb->q[2 * c + 1] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(v, 4), m4), _mm256_slli_epi16(h1, 4));
    }
#else
    for (int c = 0; c < 4; c++)
        for (int l = 0; l < 32; l++) {
            kb->q[64 * c + l] = (qs[32 * c + l] & 15) | (((qh[l] >> (2 * c)) & 1) << 4);
            kb->q[64 * c + 32 + l] = (qs[32 * c + l] >> 4) | (((qh[l] >> (2 * c + 1)) & 1) << 4);
        }
#endif
}

INLINE void decode_q6k(const uint8_t* w, kblock* kb) {
    const uint8_t *ql = w, *qh = w + 128;
    const int8_t* sc = (const int8_t*)(w + 192);
    kb->d = h2f(w + 208);
    kb->dmin = 0.0f;
    /* code 128n + 32j + l: low 4 bits ql[64n + 32(j % 2) + l] >> 4(j / 2), high 2 bits qh[32n + l] >> 2j */
#if MF_AVX2
    const __m128i s8 = _mm_loadu_si128((const __m128i*)sc);
    kb->mn = _mm256_slli_epi16(_mm256_cvtepi8_epi16(s8), 5);  /* 32 * sc */
    const __m256i sb = _mm256_broadcastsi128_si256(s8);
    for (int i = 0; i < KV; i++)  /* groups 2i (low 8 lanes) and 2i + 1: the byte into each lane's top, shifted down */
        kb->sc[i] = _mm256_srai_epi16(_mm256_shuffle_epi8(sb, _mm256_set_m128i(_mm_set1_epi16((short)((2 * i + 1) << 8 | 0x80)),
                                                                           _mm_set1_epi16((short)((2 * i) << 8 | 0x80)))), 8);
    const __m256i m4 = _mm256_set1_epi8(0x0F), m2 = _mm256_set1_epi8(3);
    for (int n = 0; n < 2; n++) {
        const __m256i l0 = _mm256_loadu_si256((const __m256i*)(ql + 64 * n));
        const __m256i l1 = _mm256_loadu_si256((const __m256i*)(ql + 64 * n + 32));
        const __m256i h = _mm256_loadu_si256((const __m256i*)(qh + 32 * n));
        const __m256i lo[4] = {_mm256_and_si256(l0, m4), _mm256_and_si256(l1, m4),
                               _mm256_and_si256(_mm256_srli_epi16(l0, 4), m4),
                               _mm256_and_si256(_mm256_srli_epi16(l1, 4), m4)};
        const __m256i hi[4] = {_mm256_and_si256(h, m2), _mm256_and_si256(_mm256_srli_epi16(h, 2), m2),
                               _mm256_and_si256(_mm256_srli_epi16(h, 4), m2),
                               _mm256_and_si256(_mm256_srli_epi16(h, 6), m2)};
        for (int j = 0; j < 4; j++) kb->q[4 * n + j] = _mm256_or_si256(lo[j], _mm256_slli_epi16(hi[j], 4));
    }
#else
    for (int g = 0; g < 16; g++) {
        kb->sc[g] = sc[g];
        kb->mn[g] = (int16_t)(32 * sc[g]);
    }
    for (int n = 0; n < 2; n++)
        for (int j = 0; j < 4; j++)
            for (int l = 0; l < 32; l++)
                kb->q[128 * n + 32 * j + l] = ((ql[64 * n + 32 * (j % 2) + l] >> (4 * (j / 2))) & 15)
                                              | (((qh[32 * n + l] >> (2 * j)) & 3) << 4);
#endif
}

#if MF_AVX2
INLINE void kdot(const kblock* kb, const int8_t* x, const int16_t* bsum, lanes* isum, lanes* imin) {
    __m256i a0 = _mm256_setzero_si256(), a1 = _mm256_setzero_si256();
    for (int i = 0; i < KV; i += 2) {
        a0 = _mm256_add_epi32(a0, _mm256_madd_epi16(
            _mm256_maddubs_epi16(kb->q[i], _mm256_loadu_si256((const __m256i*)(x + 32 * i))), kb->sc[i]));
        a1 = _mm256_add_epi32(a1, _mm256_madd_epi16(
            _mm256_maddubs_epi16(kb->q[i + 1], _mm256_loadu_si256((const __m256i*)(x + 32 * i + 32))), kb->sc[i + 1]));
    }
    *isum = _mm256_add_epi32(a0, a1);
    *imin = _mm256_madd_epi16(kb->mn, _mm256_loadu_si256((const __m256i*)bsum));
}
#else
INLINE void kdot(const kblock* kb, const int8_t* x, const int16_t* bsum, lanes* isum, lanes* imin) {
    for (int l = 0; l < 8; l++) {
        int s = 0;
        for (int i = 0; i < 8; i++)
            for (int c = 0; c < 4; c++) {
                const int p = 32 * i + 4 * l + c;
                s += kb->sc[p / 16] * kb->q[p] * x[p];
            }
        isum->v[l] = s;
        imin->v[l] = kb->mn[2 * l] * bsum[2 * l] + kb->mn[2 * l + 1] * bsum[2 * l + 1];
    }
}
#endif

#endif  /* MF_AVX512 */

#endif
