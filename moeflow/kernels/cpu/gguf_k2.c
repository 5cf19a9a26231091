/* GGUF K-quant rows two at a time on AVX-512 VNNI (Q4_K, Q5_K, Q6_K): the same integer lanes and the same fp32
   operations per row and token as gguf_k.c's one-row kernel (so the same bits on every build), in about half the
   instructions. Numerics: gguf.c's comment.

   Two rows' blocks b share a 512-bit register: row A's sub-block i (32 codes, in file order, no lane shuffles) in
   the low half, row B's in the high half; the token's 32 activation codes of that sub-block stored twice in a row
   (acts.q2) so they are one 512-bit operand. maddubs (unsigned codes x signed activations, pairs summed into int16:
   at most 2 * 63 * 127, no saturation) then vpdpwssd with the pairs' scales (int16) gives each row's 8 exact int32
   lanes (lane l: codes 32 i + 4 l + c, c < 4, times their scale: kdot's lanes) side by side, and the mins' or
   offsets' lanes by one pmaddwd; the fp32 steps (two fused multiply-adds, Q6_K one) then run for both rows in one
   instruction, lanes 0-7 row A, 8-15 row B, and each row's 8 lanes are summed as gguf.h's facc_sum. The twelve
   scale bytes of Q4_K / Q5_K are unpacked for both rows at once in 256-bit registers; weights are prefetched
   MF_Q4_PREFETCH bytes ahead. */

#include <stdint.h>
#include <string.h>

#include "gguf.h"

#if MF_AVX512
#define PT 4  /* tokens per tile: a block pair is decoded once per tile */

typedef struct {
    __m512i q[8];   /* sub-block i: row A's 32 unsigned codes (Q6_K: value + 32), row B's in the high half */
    __m512i sc[8];  /* int16: the scale of each maddubs pair of q[i] */
    __m512i mn;     /* int16 [A 16 | B 16] per 16-group: Q4/5_K the min of its 32-group, Q6_K 32 * its scale */
    __m128 dm;      /* d_A, dmin_A, d_B, dmin_B (Q6_K: dmin 0) */
} pblock;

/* vpshufb controls (within each 128-bit lane): every word = word w of the lane, w per lane */
#define W8(w) 2 * (w), 2 * (w) + 1, 2 * (w), 2 * (w) + 1, 2 * (w), 2 * (w) + 1, 2 * (w), 2 * (w) + 1
#define LANE(w) W8(w), W8(w)
static const int8_t SHUF_SC4[8][64] = {  /* [scA, scA, scB, scB] lanes -> sub-block i's scale everywhere */
#define ROW4(i) {LANE(i), LANE(i), LANE(i), LANE(i)}
    ROW4(0), ROW4(1), ROW4(2), ROW4(3), ROW4(4), ROW4(5), ROW4(6), ROW4(7)};
static const int16_t IDX_MN4[32] = {8,  8,  9,  9,  10, 10, 11, 11, 12, 12, 13, 13, 14, 14, 15, 15,
                                    24, 24, 25, 25, 26, 26, 27, 27, 28, 28, 29, 29, 30, 30, 31, 31};
static const int8_t SHUF_SC6[4][64] = {  /* [A g0-7, A g0-7, B .., B ..] or g8-15 -> groups 2i, 2i + 1 (i mod 4) */
#define ROW6(i) {LANE(2 * i), LANE(2 * i + 1), LANE(2 * i), LANE(2 * i + 1)}
    ROW6(0), ROW6(1), ROW6(2), ROW6(3)};
static const int32_t IDX_D[16] = {0, 0, 0, 0, 0, 0, 0, 0, 2, 2, 2, 2, 2, 2, 2, 2};
static const int32_t IDX_M[16] = {1, 1, 1, 1, 1, 1, 1, 1, 3, 3, 3, 3, 3, 3, 3, 3};

INLINE __m512i idx16(const int16_t* p) { return _mm512_loadu_si512((const void*)p); }
INLINE __m512i idx8(const int8_t* p) { return _mm512_loadu_si512((const void*)p); }

/* 32 bytes at a (low half) and at b (high half): a masked load in place of a lane insert (no shuffle) */
INLINE __m512i load2(const uint8_t* a, const uint8_t* b) {
    return _mm512_mask_loadu_epi64(_mm512_castsi256_si512(_mm256_loadu_si256((const __m256i*)a)), 0xF0, b - 32);
}

/* Q4_K / Q5_K: the twelve scale bytes of both blocks (k4_scales' unpacking, per 128-bit half) -> int16 words
   [scA 0-7, mnA 0-7, scB 0-7, mnB 0-7]. Dwords of a half: w0 w1 w2 (the 16 bytes read end inside the block). */
INLINE __m512i k4_scales2(const uint8_t* sa, const uint8_t* sb) {
    const __m256i v = _mm256_inserti128_si256(_mm256_castsi128_si256(_mm_loadu_si128((const __m128i*)sa)),
                                              _mm_loadu_si128((const __m128i*)sb), 1);
    const __m256i a = _mm256_shuffle_epi32(v, _MM_SHUFFLE(2, 1, 2, 0));  /* w0 w2 w1 w2 */
    const __m256i b = _mm256_shuffle_epi32(v, _MM_SHUFFLE(1, 1, 0, 0));  /* w0 w0 w1 w1 */
    const __m256i lo = _mm256_and_si256(a, _mm256_set1_epi8(0x3F));      /* scales 0-3, mins 0-3 */
    const __m256i hi = _mm256_or_si256(  /* scales 4-7, mins 4-7: low 4 bits from w2, top 2 from w0 / w1 */
        _mm256_and_si256(_mm256_srlv_epi32(a, _mm256_setr_epi32(0, 0, 0, 4, 0, 0, 0, 4)), _mm256_set1_epi8(0x0F)),
        _mm256_and_si256(_mm256_srli_epi32(b, 2), _mm256_set1_epi8(0x30)));
    return _mm512_cvtepu8_epi16(_mm256_blend_epi32(lo, hi, 0xAA));
}

/* bit k of each byte of h moved to bit s (the rest 0) */
INLINE __m512i bit_to(__m512i h, int k, int s, int mask) {
    const __m512i m = _mm512_set1_epi8((char)mask);
    if (k < s) return _mm512_and_si512(_mm512_slli_epi16(h, s - k), m);
    if (k > s) return _mm512_and_si512(_mm512_srli_epi16(h, k - s), m);
    return _mm512_and_si512(h, m);
}

INLINE void decode_k4_pair(int type, const uint8_t* wa, const uint8_t* wb, pblock* pb) {
    pb->dm = _mm_cvtph_ps(_mm_insert_epi32(_mm_cvtsi32_si128(*(const int*)wa), *(const int*)wb, 1));
    const __m512i s = k4_scales2(wa + 4, wb + 4);
    const __m512i ss = _mm512_shuffle_i64x2(s, s, _MM_SHUFFLE(2, 2, 0, 0));  /* lanes scA scA scB scB */
    for (int i = 0; i < 8; i++) pb->sc[i] = _mm512_shuffle_epi8(ss, idx8(SHUF_SC4[i]));
    pb->mn = _mm512_permutexvar_epi16(idx16(IDX_MN4), s);
    const int o = type == GG_Q4_K ? 16 : 48;  /* chunk c of qs: sub-block 2c in the low nibbles, 2c + 1 high */
    const __m512i m4 = _mm512_set1_epi8(0x0F);
    for (int c = 0; c < 4; c++) {
        const __m512i v = load2(wa + o + 32 * c, wb + o + 32 * c);
        pb->q[2 * c] = _mm512_and_si512(v, m4);
        pb->q[2 * c + 1] = _mm512_and_si512(_mm512_srli_epi16(v, 4), m4);
    }
    if (type == GG_Q5_K) {  /* bit i of qh[l]: bit 4 of code 32 i + l */
        const __m512i h = load2(wa + 16, wb + 16);
        for (int i = 0; i < 8; i++) pb->q[i] = _mm512_or_si512(pb->q[i], bit_to(h, i, 4, 0x10));
    }
}

INLINE void decode_q6k_pair(const uint8_t* wa, const uint8_t* wb, pblock* pb) {
    uint16_t da, db;
    memcpy(&da, wa + 208, 2);
    memcpy(&db, wb + 208, 2);
    pb->dm = _mm_cvtph_ps(_mm_setr_epi16((short)da, 0, (short)db, 0, 0, 0, 0, 0));
    const __m512i s = _mm512_cvtepi8_epi16(_mm256_inserti128_si256(
        _mm256_castsi128_si256(_mm_loadu_si128((const __m128i*)(wa + 192))),
        _mm_loadu_si128((const __m128i*)(wb + 192)), 1));
    const __m512i s0 = _mm512_shuffle_i64x2(s, s, _MM_SHUFFLE(2, 2, 0, 0));  /* A g0-7 twice, B g0-7 twice */
    const __m512i s1 = _mm512_shuffle_i64x2(s, s, _MM_SHUFFLE(3, 3, 1, 1));  /* g8-15 */
    for (int i = 0; i < 8; i++) pb->sc[i] = _mm512_shuffle_epi8(i < 4 ? s0 : s1, idx8(SHUF_SC6[i % 4]));
    pb->mn = _mm512_slli_epi16(s, 5);  /* 32 * sc */
    /* code 128n + 32j + l (sub-block 4n + j): low 4 bits ql[64n + 32(j % 2) + l] >> 4(j / 2), high 2 bits
       qh[32n + l] >> 2j */
    const __m512i m4 = _mm512_set1_epi8(0x0F);
    for (int n = 0; n < 2; n++) {
        const __m512i l0 = load2(wa + 64 * n, wb + 64 * n), l1 = load2(wa + 64 * n + 32, wb + 64 * n + 32);
        const __m512i h = load2(wa + 128 + 32 * n, wb + 128 + 32 * n);
        const __m512i lo[4] = {_mm512_and_si512(l0, m4), _mm512_and_si512(l1, m4),
                               _mm512_and_si512(_mm512_srli_epi16(l0, 4), m4),
                               _mm512_and_si512(_mm512_srli_epi16(l1, 4), m4)};
        for (int j = 0; j < 4; j++) pb->q[4 * n + j] = _mm512_or_si512(lo[j], bit_to(h, 2 * j, 4, 0x30));
    }
}

/* One token against a decoded pair: each row's 8 exact int32 lanes (isum: A low, B high; imin likewise). */
INLINE void pdot(const pblock* pb, const int8_t* x2, const int16_t* bsum, __m512i* isum, __m512i* imin) {
    __m512i a0 = _mm512_setzero_si512(), a1 = _mm512_setzero_si512();  /* two chains: exact integer adds */
    for (int i = 0; i < 8; i += 2) {
        a0 = _mm512_dpwssd_epi32(a0, _mm512_maddubs_epi16(pb->q[i], _mm512_loadu_si512((const void*)(x2 + 64 * i))),
                                 pb->sc[i]);
        a1 = _mm512_dpwssd_epi32(a1, _mm512_maddubs_epi16(pb->q[i + 1],
                                 _mm512_loadu_si512((const void*)(x2 + 64 * i + 64))), pb->sc[i + 1]);
    }
    *isum = _mm512_add_epi32(a0, a1);
    *imin = _mm512_madd_epi16(pb->mn, _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i*)bsum)));
}

/* Rows A and B (nb blocks each) against the tokens t0 .. t0 + tt: y[t * ldy] (row A) and y[t * ldy + 1] (B). */
INLINE void ptile(int type, const uint8_t* ra, const uint8_t* rb, int nb, int t0, int tt, const acts* a, float* y,
                  int ldy) {
    const int K = a->K, tb = type_bytes(type);
    __m512 acc[PT];
    for (int i = 0; i < tt; i++) acc[i] = _mm512_setzero_ps();
    const __m512i id = _mm512_loadu_si512((const void*)IDX_D), im = _mm512_loadu_si512((const void*)IDX_M);
    const __m128 neg = _mm_castsi128_ps(_mm_setr_epi32(0, (int)0x80000000u, 0, (int)0x80000000u));
    for (int b = 0; b < nb; b++) {
        const uint8_t *wa = ra + (size_t)b * tb, *wb = rb + (size_t)b * tb;
        for (int o = 0; o < tb; o += 64) {
            _mm_prefetch((const char*)(wa + MF_Q4_PREFETCH + o), _MM_HINT_T0);
            _mm_prefetch((const char*)(wb + MF_Q4_PREFETCH + o), _MM_HINT_T0);
        }
        pblock pb;
        if (type == GG_Q6_K) decode_q6k_pair(wa, wb, &pb);
        else decode_k4_pair(type, wa, wb, &pb);
        for (int i = 0; i < tt; i++) {
            const int t = t0 + i;
            __m512i is, imn;
            pdot(&pb, a->q2 + (size_t)t * 2 * K + (size_t)b * 2 * QKK, a->sum + (size_t)t * (K / 16) + 16 * b, &is,
                 &imn);
            /* d xs, -(dmin xs) per row, as the one-row kernel's scalars */
            const __m128 f = _mm_xor_ps(_mm_mul_ps(pb.dm, _mm_set1_ps(a->s[(size_t)t * (K / QKK) + b])), neg);
            const __m512 fz = _mm512_castps128_ps512(f);
            const __m512 dx = _mm512_permutexvar_ps(id, fz);
            if (type == GG_Q6_K) {
                acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(is, imn)), dx, acc[i]);
            } else {
                acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(is), dx, acc[i]);
                acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(imn), _mm512_permutexvar_ps(im, fz), acc[i]);
            }
        }
    }
    for (int i = 0; i < tt; i++) {
        float* yt = y + (size_t)(t0 + i) * ldy;
        yt[0] = facc_sum(_mm512_castps512_ps256(acc[i]));
        yt[1] = facc_sum(_mm512_extractf32x8_ps(acc[i], 1));
    }
}

INLINE void prow(int type, const uint8_t* ra, const uint8_t* rb, int nb, int T, const acts* a, float* y, int ldy) {
    int t0 = 0;
    for (; t0 + PT <= T; t0 += PT) ptile(type, ra, rb, nb, t0, PT, a, y, ldy);
    if (T - t0 >= 2) { ptile(type, ra, rb, nb, t0, 2, a, y, ldy); t0 += 2; }
    if (T - t0 >= 1) ptile(type, ra, rb, nb, t0, 1, a, y, ldy);
}

void mf_gguf_krow2(int type, const uint8_t* ra, const uint8_t* rb, int nb, int T, const acts* a, float* y, int ldy) {
    switch (type) {  /* one copy per type, its decode inlined */
        case GG_Q4_K: prow(GG_Q4_K, ra, rb, nb, T, a, y, ldy); break;
        case GG_Q5_K: prow(GG_Q5_K, ra, rb, nb, T, a, y, ldy); break;
        default: prow(GG_Q6_K, ra, rb, nb, T, a, y, ldy); break;
    }
}
#endif
