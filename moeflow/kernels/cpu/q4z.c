/* moeflow's q4 kernel at group 32 with integer zero points (issue 42): MF_Q4_F16Z at group 32 and MF_Q4_F16Z8
   (GGUF's Q4_0: every zero point 8, none stored, m unused), on q4.c's layout (its comment), behind mf_q4_rows.

   The zero point is folded into each block's integer sum, d = dot - z * xsum (xsum: the
   block's sum of the token's int8 activations, from native.c's quantize_row), then acc = fma(float(d), s * xs,
   acc) per block: one fp32 fma per block and token where the min term would cost a second (the scales' and
   zeros' loads and conversions, shared by a tile), and fewer roundings. W = (q - z) * s is the same weight.
   Every path (AVX-512, AVX2, portable, tail rows) computes the same integers and these fp32 operations in block
   order: the same bits (tests/test_cpu_isa.py, tests/test_cpu_q4_group32.py).

   Scales: fp16 s[8R * nb + 8b + r] (row group R, block b, row r; a tail row n: s[n * nb + b]), zeros likewise
   (uint8, MF_Q4_F16Z). The tiles are q4.c's (the AVX2 maddubs tile, AVX-512's single row group on 256-bit vpdpbusd
   below Q4_PAIR_MIN_T tokens, two row groups per register from there) with the min term replaced. */

#include <math.h>
#include <stddef.h>
#include <string.h>

#include "native.h"

#define TT 4            /* as q4.c: tokens per register tile */
#define PREFETCH MF_Q4_PF_DIST  /* as q4.c (native.h): into L2 */
#define Q4_PAIR_MIN_T 4 /* as q4.c: two row groups per register from this many tokens (AVX-512) */

/* One block of the group-32 integer-zero-point path for element i of the scales (and zeros): acc = fma(float(dot -
   z * xsum), s * xs, acc), a vector lane's operations. */
static inline float q4z_block(int dot, const void* s, const void* m, int fmt, size_t i, float xs, int32_t xsum,
                              float acc) {
    const int z = fmt == MF_Q4_F16Z8 ? 8 : ((const uint8_t*)m)[i];
    const float sc = mf_half_to_float(((const uint16_t*)s)[i]) * xs;
    return fmaf((float)(dot - z * xsum), sc, acc);
}

#if MF_AVX2
/* The 8 rows' zero points of block b (group 32), int32: stored (MF_Q4_F16Z) or 8 (MF_Q4_F16Z8). */
static inline __attribute__((always_inline)) __m256i q4_zeros8(const void* m, int fmt, int b) {
    if (fmt == MF_Q4_F16Z8) return _mm256_set1_epi32(8);
    return _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)((const uint8_t*)m + 8 * b)));
}

/* Prefetch of the group-32 scales (and zeros) of block b + PREFETCH / 128 (the weight stream's distance): one
   64-byte line holds 4 blocks' scales of a row group (8 of its zeros), so every 4th block asks for the next. */
static inline __attribute__((always_inline)) void q4z_prefetch(const void* s, const void* m, int fmt, int b) {
    if (b % 4 == 0) {
        _mm_prefetch((const char*)((const uint16_t*)s + 8 * (b + PREFETCH / 128)), MF_Q4_PF_HINT);
        if (fmt == MF_Q4_F16Z && b % 8 == 0)
            _mm_prefetch((const char*)((const uint8_t*)m + 8 * (b + PREFETCH / 128)), MF_Q4_PF_HINT);
    }
}

/* q4_group_tile at group 32 with the zero points folded into the integer sums (see the file comment). */
static inline __attribute__((always_inline)) void q4z_group_tile(
    const uint8_t* w, const void* s, const void* m, int fmt, int K, const int8_t* xq, const float* xs,
    const int32_t* xsum, int t0, int tt, float* y, int ldy, int n) {
    const int nb = K / QB;
    const __m256i low = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
    __m256 acc[TT];
    for (int i = 0; i < tt; i++) acc[i] = _mm256_setzero_ps();
    for (int b = 0; b < nb; b++) {
        const uint8_t* wb = w + (size_t)b * 128;
        _mm_prefetch((const char*)(wb + PREFETCH), MF_Q4_PF_HINT);
        _mm_prefetch((const char*)(wb + PREFETCH + 64), MF_Q4_PF_HINT);
        q4z_prefetch(s, m, fmt, b);
        const __m256 sv = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)((const uint16_t*)s + 8 * b)));
        const __m256i zv = q4_zeros8(m, fmt, b);
        __m256i dot[TT];
        for (int i = 0; i < tt; i++) dot[i] = _mm256_setzero_si256();
        for (int c = 0; c < 4; c++) {
            const __m256i p = _mm256_loadu_si256((const __m256i*)(wb + 32 * c));
            const __m256i lo = _mm256_and_si256(p, low);
            const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(p, 4), low);
            for (int i = 0; i < tt; i++) {
                const int8_t* xb = xq + (size_t)(t0 + i) * K + b * QB + 8 * c;
                const __m256i d = _mm256_add_epi16(_mm256_maddubs_epi16(lo, bcast4(xb)),
                                                   _mm256_maddubs_epi16(hi, bcast4(xb + 4)));
                dot[i] = _mm256_add_epi16(dot[i], d);
            }
            for (int i = 0; i < tt; i++) __asm__("" : "+x"(dot[i]));
        }
        for (int i = 0; i < tt; i++) {
            const __m256i zx = _mm256_mullo_epi32(zv, _mm256_set1_epi32(xsum[(size_t)(t0 + i) * nb + b]));
            const __m256i d = _mm256_sub_epi32(_mm256_madd_epi16(dot[i], ones), zx);
            const __m256 scale = _mm256_mul_ps(sv, _mm256_broadcast_ss(xs + (size_t)(t0 + i) * nb + b));
            acc[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(d), scale, acc[i]);
        }
    }
    for (int i = 0; i < tt; i++) _mm256_storeu_ps(y + (size_t)(t0 + i) * ldy + n, acc[i]);
}

#if MF_AVX512
/* q4_group_tile512 at group 32 with the zero points folded into the integer sums (mf_q4_block_dots256): the AVX2
   tile's integers and fp32 operations (the same bits). */
static inline __attribute__((always_inline)) void q4z_group_tile512(
    const uint8_t* w, const void* s, const void* m, int fmt, int K, const int8_t* xq, const float* xs,
    const int32_t* xsum, int t0, int tt, float* y, int ldy, int n) {
    const int nb = K / QB;
    __m256 acc[TT];
    for (int i = 0; i < tt; i++) acc[i] = _mm256_setzero_ps();
    MF_UNROLL(2)  /* two blocks per pass: -16-25 % at 1 token from the L2 cache, none from DRAM (s17) */
    for (int b = 0; b < nb; b++) {
        const uint8_t* wb = w + (size_t)b * 128;
        _mm_prefetch((const char*)(wb + PREFETCH), MF_Q4_PF_HINT);
        _mm_prefetch((const char*)(wb + PREFETCH + 64), MF_Q4_PF_HINT);
        q4z_prefetch(s, m, fmt, b);
        const __m256 sv = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)((const uint16_t*)s + 8 * b)));
        const __m256i zv = q4_zeros8(m, fmt, b);
        __m256i dd[TT];
        mf_q4_block_dots256(wb, xq, K, b, t0, tt, dd);
        for (int i = 0; i < tt; i++) {
            const __m256i d8 = _mm256_sub_epi32(
                dd[i], _mm256_mullo_epi32(zv, _mm256_set1_epi32(xsum[(size_t)(t0 + i) * nb + b])));
            const __m256 scale = _mm256_mul_ps(sv, _mm256_broadcast_ss(xs + (size_t)(t0 + i) * nb + b));
            acc[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(d8), scale, acc[i]);
        }
    }
    for (int i = 0; i < tt; i++) _mm256_storeu_ps(y + (size_t)(t0 + i) * ldy + n, acc[i]);
}
#define Q4Z_TILE q4z_group_tile512

/* q4_pair_tile at group 32 with the zero points folded into the integer sums: per row the single group's integers
   and fp32 operations (the same bits). */
static inline __attribute__((always_inline)) void q4z_pair_tile(
    const uint8_t* w, const void* s, const void* m, int fmt, int K, const int8_t* xq, const float* xs,
    const int32_t* xsum, int t0, int tt, float* y, int ldy, int n) {
    const int nb = K / QB;
    const size_t wb_off = (size_t)Q4_GROUP * K / 2, sm_off = (size_t)Q4_GROUP * nb;  /* group B after A */
    __m512 acc[TT];
    for (int i = 0; i < tt; i++) acc[i] = _mm512_setzero_ps();
    for (int b = 0; b < nb; b++) {
        const uint8_t* wa = w + (size_t)b * 128;
        q4z_prefetch(s, m, fmt, b);
        q4z_prefetch((const uint16_t*)s + sm_off, (const uint8_t*)m + sm_off, fmt, b);
        const uint16_t* s16 = (const uint16_t*)s + 8 * b;
        const __m512 sv = _mm512_cvtph_ps(_mm256_inserti128_si256(_mm256_castsi128_si256(
            _mm_loadu_si128((const __m128i*)s16)), _mm_loadu_si128((const __m128i*)(s16 + sm_off)), 1));
        __m512i zv;
        if (fmt == MF_Q4_F16Z8) {
            zv = _mm512_set1_epi32(8);
        } else {
            const uint8_t* z8 = (const uint8_t*)m + 8 * b;
            zv = _mm512_cvtepu8_epi32(_mm_unpacklo_epi64(_mm_loadl_epi64((const __m128i*)z8),
                                                          _mm_loadl_epi64((const __m128i*)(z8 + sm_off))));
        }
        __m512i dot[TT][4];  /* as q4.c's: four independent sums, the zero points' share taken after */
        mf_q4_pair_block_dots(wa, wb_off, xq, K, b, t0, tt, dot);
        for (int i = 0; i < tt; i++) {
            const __m512i d = _mm512_sub_epi32(
                _mm512_add_epi32(_mm512_add_epi32(dot[i][0], dot[i][1]), _mm512_add_epi32(dot[i][2], dot[i][3])),
                _mm512_mullo_epi32(zv, _mm512_set1_epi32(xsum[(size_t)(t0 + i) * nb + b])));
            const __m512 scale = _mm512_mul_ps(sv, _mm512_set1_ps(xs[(size_t)(t0 + i) * nb + b]));
            acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(d), scale, acc[i]);
        }
    }
    for (int i = 0; i < tt; i++) _mm512_storeu_ps(y + (size_t)(t0 + i) * ldy + n, acc[i]);
}

static inline __attribute__((always_inline)) void q4z_pair_fmt(
    const uint8_t* w, const void* s, const void* m, int fmt, int T, int K, const int8_t* xq, const float* xs,
    const int32_t* xsum, float* y, int ldy, int n) {
    int t0 = 0;
    for (; t0 + TT <= T; t0 += TT) q4z_pair_tile(w, s, m, fmt, K, xq, xs, xsum, t0, TT, y, ldy, n);
    switch (T - t0) {
        case 1: q4z_pair_tile(w, s, m, fmt, K, xq, xs, xsum, t0, 1, y, ldy, n); break;
        case 2: q4z_pair_tile(w, s, m, fmt, K, xq, xs, xsum, t0, 2, y, ldy, n); break;
        case 3: q4z_pair_tile(w, s, m, fmt, K, xq, xs, xsum, t0, 3, y, ldy, n); break;
        default: break;
    }
}
#else
#define Q4Z_TILE q4z_group_tile
#endif

static inline __attribute__((always_inline)) void q4z_group_fmt(
    const uint8_t* w, const void* s, const void* m, int fmt, int T, int K, const int8_t* xq, const float* xs,
    const int32_t* xsum, float* y, int ldy, int n) {
    int t0 = 0;
    for (; t0 + TT <= T; t0 += TT) Q4Z_TILE(w, s, m, fmt, K, xq, xs, xsum, t0, TT, y, ldy, n);
    switch (T - t0) {
        case 1: Q4Z_TILE(w, s, m, fmt, K, xq, xs, xsum, t0, 1, y, ldy, n); break;
        case 2: Q4Z_TILE(w, s, m, fmt, K, xq, xs, xsum, t0, 2, y, ldy, n); break;
        case 3: Q4Z_TILE(w, s, m, fmt, K, xq, xs, xsum, t0, 3, y, ldy, n); break;
        default: break;
    }
}

static void q4z_group(const uint8_t* w, const void* s, const void* m, int fmt, int T, int K, const int8_t* xq,
                      const float* xs, const int32_t* xsum, float* y, int ldy, int n) {
    if (fmt == MF_Q4_F16Z8)  /* each form compiled on its own */
        q4z_group_fmt(w, s, m, MF_Q4_F16Z8, T, K, xq, xs, xsum, y, ldy, n);
    else
        q4z_group_fmt(w, s, m, MF_Q4_F16Z, T, K, xq, xs, xsum, y, ldy, n);
}
#else
/* The portable loops (machines without AVX2): the vector lanes' operations, so the same bits. */
static void q4z_group(const uint8_t* w, const void* s, const void* m, int fmt, int T, int K, const int8_t* xq,
                      const float* xs, const int32_t* xsum, float* y, int ldy, int n) {
    const int nb = K / QB;
    for (int t = 0; t < T; t++)
        for (int r = 0; r < Q4_GROUP; r++) {
            float a = 0.0f;
            for (int b = 0; b < nb; b++) {
                int dot = 0;
                for (int c = 0; c < 4; c++)
                    for (int j = 0; j < 4; j++) {
                        const uint8_t v = w[(size_t)b * 128 + 32 * c + 4 * r + j];
                        dot += (v & 0xF) * xq[(size_t)t * K + b * QB + 8 * c + j] +
                               (v >> 4) * xq[(size_t)t * K + b * QB + 8 * c + 4 + j];
                    }
                a = q4z_block(dot, s, m, fmt, (size_t)8 * b + r, xs[(size_t)t * nb + b], xsum[(size_t)t * nb + b], a);
            }
            y[(size_t)t * ldy + n + r] = a;
        }
}
#endif

/* A tail row (plain row layout) against all T tokens: a grouped row's lane operations (the same bits). */
static void q4z_tail_row(const uint8_t* row, const void* s, const void* m, int fmt, int T, int K, const int8_t* xq,
                         const float* xs, const int32_t* xsum, float* y, int ldy, int n) {
    const int nb = K / QB;
    for (int t = 0; t < T; t++) {
        const int8_t* xt = xq + (size_t)t * K;
        float a = 0.0f;
        for (int b = 0; b < nb; b++) {
            int dot = 0;
            for (int j = 0; j < QB / 2; j++)
                dot += (row[b * 16 + j] & 0xF) * xt[b * QB + j] + (row[b * 16 + j] >> 4) * xt[b * QB + 16 + j];
            a = q4z_block(dot, s, m, fmt, (size_t)b, xs[(size_t)t * nb + b], xsum[(size_t)t * nb + b], a);
        }
        y[(size_t)t * ldy + n] = a;
    }
}

void mf_q4z_rows(int n0, int n1, int T, int K, int fmt, const uint8_t* qw, const void* s, const void* m,
                 const int8_t* xq, const float* xs, const int32_t* xsum, float* y, int ldy) {
    const size_t nb = (size_t)(K / QB), half = (size_t)(K / 2), ms = fmt == MF_Q4_F16Z ? 1 : 0;
    const uint16_t* s16 = (const uint16_t*)s;
    const uint8_t* z8 = (const uint8_t*)m;
    int n = n0;  /* n0 is a multiple of 8; rows past the last whole group only in the last call (n1 = N) */
#if MF_AVX512
    if (T >= Q4_PAIR_MIN_T)
        for (; n + 2 * Q4_GROUP <= n1; n += 2 * Q4_GROUP) {
            if (fmt == MF_Q4_F16Z8)
                q4z_pair_fmt(qw + n * half, s16 + n * nb, z8, MF_Q4_F16Z8, T, K, xq, xs, xsum, y, ldy, n);
            else
                q4z_pair_fmt(qw + n * half, s16 + n * nb, z8 + n * nb, MF_Q4_F16Z, T, K, xq, xs, xsum, y, ldy, n);
        }
#endif
    for (; n + Q4_GROUP <= n1; n += Q4_GROUP)
        q4z_group(qw + n * half, s16 + n * nb, z8 + n * nb * ms, fmt, T, K, xq, xs, xsum, y, ldy, n);
    for (; n < n1; n++)
        q4z_tail_row(qw + n * half, s16 + n * nb, z8 + n * nb * ms, fmt, T, K, xq, xs, xsum, y, ldy, n);
}
