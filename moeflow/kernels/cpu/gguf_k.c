/* GGUF experts on the CPU: the K-quant blocks (Q4_K, Q5_K, Q6_K) decoded and multiplied by int8 activations in
   blocks of 256 (llama.cpp's Q8_K). Numerics and layout: gguf.c's comment. */

#include <math.h>
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

/* A K-quant block's share of a token's 8 fp32 lanes (gguf.h's facc): acc[l] = fma(isum_l, d xs, acc[l]) then
   fma(imin_l, -(dmin xs), acc[l]) (Q6_K: one fma of isum_l - imin_l). */
#if MF_AVX2
INLINE facc facc_add(int type, facc acc, lanes is, lanes im, float dx, float mx) {
    if (type == GG_Q6_K) return _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_sub_epi32(is, im)), _mm256_set1_ps(dx), acc);
    acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(is), _mm256_set1_ps(dx), acc);
    return _mm256_fmadd_ps(_mm256_cvtepi32_ps(im), _mm256_set1_ps(mx), acc);
}
/* facc_add for Q4_K / Q5_K with its two products formed in one multiply: dd = (d, dmin) from the block's two fp16
   fields, (d xs, dmin xs) = dd * xs, and fma(imin, -(dmin xs), acc) as fnmadd(imin, dmin xs, acc) (the same
   rounding of the same exact value): facc_add's bits. */
INLINE __m128 k4_dd(const uint8_t* w) {
    int32_t v;
    memcpy(&v, w, 4);
    return _mm_cvtph_ps(_mm_cvtsi32_si128(v));
}
INLINE facc facc_add_k4(facc acc, lanes is, lanes im, __m128 dd, float xs) {
    const __m256 f = _mm256_castps128_ps256(_mm_mul_ps(dd, _mm_set1_ps(xs)));
    acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(is), _mm256_permutevar8x32_ps(f, _mm256_setzero_si256()), acc);
    return _mm256_fnmadd_ps(_mm256_cvtepi32_ps(im), _mm256_permutevar8x32_ps(f, _mm256_set1_epi32(1)), acc);
}
#else
INLINE facc facc_add(int type, facc acc, lanes is, lanes im, float dx, float mx) {
    for (int l = 0; l < 8; l++) {
        if (type == GG_Q6_K) {
            acc.v[l] = fmaf((float)(is.v[l] - im.v[l]), dx, acc.v[l]);
        } else {
            acc.v[l] = fmaf((float)is.v[l], dx, acc.v[l]);
            acc.v[l] = fmaf((float)im.v[l], mx, acc.v[l]);
        }
    }
    return acc;
}
#endif

/* Q4_K (session 19): a block's 8 integer lanes summed into one exact isum and one imin per token, then across
   blocks A = fma(isum, d xs, A), B = fma(imin, dmin xs, B), y = A - B: the numbers of the 8-row interleaved form
   (gguf_q4kx8.c), which sums each row's block in one register lane. kacc holds (A, B). */
#if MF_AVX2
typedef __m128 kacc;  /* (A, B, 0, 0) */
typedef __m128 kdd;   /* (d, dmin, 0, 0): k4_dd */
INLINE kacc kacc_zero(void) { return _mm_setzero_ps(); }
INLINE kacc kacc_add(kacc acc, lanes is, lanes im, kdd dd, float xs) {
    const __m256i t = _mm256_hadd_epi32(is, im);
    __m128i u = _mm_add_epi32(_mm256_castsi256_si128(t), _mm256_extracti128_si256(t, 1));
    u = _mm_hadd_epi32(u, u);  /* (isum, imin, isum, imin) */
    return _mm_fmadd_ps(_mm_cvtepi32_ps(u), _mm_mul_ps(dd, _mm_set1_ps(xs)), acc);
}
INLINE float kacc_y(kacc acc) { return _mm_cvtss_f32(_mm_sub_ss(acc, _mm_movehdup_ps(acc))); }
#else
typedef struct { float a, b; } kacc;
typedef struct { float d, dmin; } kdd;
INLINE kacc kacc_zero(void) { kacc z = {0.0f, 0.0f}; return z; }
INLINE kacc kacc_add(kacc acc, lanes is, lanes im, kdd dd, float xs) {
    int32_t s = 0, m = 0;
    for (int l = 0; l < 8; l++) { s += is.v[l]; m += im.v[l]; }
    acc.a = fmaf((float)s, dd.d * xs, acc.a);
    acc.b = fmaf((float)m, dd.dmin * xs, acc.b);
    return acc;
}
INLINE float kacc_y(kacc acc) { return acc.a - acc.b; }
#endif

INLINE void q4k_tile(const uint8_t* row, int nb, int t0, int tt, const acts* a, float* y, int ldy) {
    const int K = a->K;
    kacc acc[GTT];
    for (int i = 0; i < tt; i++) acc[i] = kacc_zero();
    for (int b = 0; b < nb; b++) {
        const uint8_t* w = row + (size_t)b * 144;
#if MF_AVX2
        for (int o = 0; o < 144; o += 64) _mm_prefetch((const char*)(w + MF_Q4_PREFETCH + o), _MM_HINT_T0);
        const kdd dd = k4_dd(w);
#else
        const kdd dd = {h2f(w), h2f(w + 2)};
#endif
        const int8_t* xq = a->q + (size_t)b * QKK;
        const int16_t* bs = a->sum + 16 * (size_t)b;
        const float* xs = a->s + b;
#if MF_AVX512
        q4kblock kb;
        decode_q4k_512(w, &kb);
#else
        kblock kb;
        decode_q4k(w, &kb);
#endif
        for (int i = 0; i < tt; i++) {
            lanes is, im;
#if MF_AVX512
            kdotq4k_512(&kb, xq + (size_t)(t0 + i) * K, bs + (size_t)(t0 + i) * (K / 16), &is, &im);
#else
            kdot(&kb, xq + (size_t)(t0 + i) * K, bs + (size_t)(t0 + i) * (K / 16), &is, &im);
#endif
            acc[i] = kacc_add(acc[i], is, im, dd, xs[(size_t)(t0 + i) * (K / QKK)]);
        }
    }
    for (int i = 0; i < tt; i++) y[(size_t)(t0 + i) * ldy] = kacc_y(acc[i]);
}

INLINE void q4k_row(const uint8_t* row, int nb, int T, const acts* a, float* y, int ldy) {
    int t0 = 0;
    for (; t0 + GTT <= T; t0 += GTT) q4k_tile(row, nb, t0, GTT, a, y, ldy);
    if (T - t0 >= 4) { q4k_tile(row, nb, t0, 4, a, y, ldy); t0 += 4; }
    if (T - t0 >= 2) { q4k_tile(row, nb, t0, 2, a, y, ldy); t0 += 2; }
    if (T - t0 >= 1) q4k_tile(row, nb, t0, 1, a, y, ldy);
}

/* Row `row` (nb blocks of K-quant `type`: Q5_K, Q6_K) against the tokens t0 .. t0 + tt: y[t * ldy]. `type` and `tt` are
   constants after inlining, so the tile's accumulators stay in registers. */
INLINE void ktile(int type, const uint8_t* row, int nb, int t0, int tt, const acts* a, float* y, int ldy) {
    const int K = a->K, tb = type_bytes(type);
    facc acc[GTT];
    for (int i = 0; i < tt; i++) acc[i] = facc_zero();
    for (int b = 0; b < nb; b++) {
        const uint8_t* w = row + (size_t)b * tb;
#if MF_AVX2
        /* q4.c's distance; Q6_K ran ~12% slower from memory with it into L1 (paired runs, s16), ~10% faster (the
           32000-row head) as a non-temporal prefetch (s17: benchmarks/results/peers/s17/kquant_README.md) */
        for (int o = 0; o < tb; o += 64)
            _mm_prefetch((const char*)(w + MF_Q4_PREFETCH + o), type == GG_Q6_K ? _MM_HINT_NTA : _MM_HINT_T0);
#endif
        const int8_t* xq = a->q + (size_t)b * QKK;
        const int16_t* bs = a->sum + 16 * (size_t)b;
        const float* xs = a->s + b;
#define TOKEN(i) xq + (size_t)(t0 + i) * K, bs + (size_t)(t0 + i) * (K / 16)
#define XS(i) xs[(size_t)(t0 + i) * (K / QKK)]
#if MF_AVX512
        if (type == GG_Q6_K) {
            k6block kb;
            decode_k6_512(w, &kb);
            for (int i = 0; i < tt; i++) {
                lanes is, im;
                kdot6_512(&kb, TOKEN(i), &is, &im);
                acc[i] = facc_add(type, acc[i], is, im, kb.d * XS(i), 0.0f);
            }
        } else {
            k4block kb;
            decode_k4_512(type, w, &kb);
            const __m128 dd = k4_dd(w);
            for (int i = 0; i < tt; i++) {
                lanes is, im;
                kdot4_512(&kb, TOKEN(i), &is, &im);
                acc[i] = facc_add_k4(acc[i], is, im, dd, XS(i));
            }
        }
#else
        kblock kb;
        if (type == GG_Q5_K) decode_q5k(w, &kb);
        else decode_q6k(w, &kb);
#if MF_AVX2
        if (type != GG_Q6_K) {
            const __m128 dd = k4_dd(w);
            for (int i = 0; i < tt; i++) {
                lanes is, im;
                kdot(&kb, TOKEN(i), &is, &im);
                acc[i] = facc_add_k4(acc[i], is, im, dd, XS(i));
            }
            continue;
        }
#endif
        for (int i = 0; i < tt; i++) {
            lanes is, im;
            kdot(&kb, TOKEN(i), &is, &im);
            acc[i] = facc_add(type, acc[i], is, im, kb.d * XS(i), -(kb.dmin * XS(i)));
        }
#endif
#undef TOKEN
#undef XS
    }
    for (int i = 0; i < tt; i++) y[(size_t)(t0 + i) * ldy] = facc_sum(acc[i]);
}

/* All T tokens in tiles of 8, then one of 4, 2 and 1 as needed (a block is decoded once per tile). */
INLINE void krow(int type, const uint8_t* row, int nb, int T, const acts* a, float* y, int ldy) {
    int t0 = 0;
    for (; t0 + GTT <= T; t0 += GTT) ktile(type, row, nb, t0, GTT, a, y, ldy);
    if (T - t0 >= 4) { ktile(type, row, nb, t0, 4, a, y, ldy); t0 += 4; }
    if (T - t0 >= 2) { ktile(type, row, nb, t0, 2, a, y, ldy); t0 += 2; }
    if (T - t0 >= 1) ktile(type, row, nb, t0, 1, a, y, ldy);
}

void mf_gguf_krows(int type, const uint8_t* w, int64_t stride, int n0, int n1, int nb, int T, const acts* a, float* y,
                   int ldy) {
    switch (type) {  /* one copy of the row loop per type, its decode inlined (no call per row) */
        case GG_Q4_K:
            for (int n = n0; n < n1; n++) q4k_row(w + (size_t)n * stride, nb, T, a, y + n, ldy);
            break;
        case GG_Q5_K:
            for (int n = n0; n < n1; n++) krow(GG_Q5_K, w + (size_t)n * stride, nb, T, a, y + n, ldy);
            break;
        default:
            for (int n = n0; n < n1; n++) krow(GG_Q6_K, w + (size_t)n * stride, nb, T, a, y + n, ldy);
            break;
    }
}
