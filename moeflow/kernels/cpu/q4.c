/* moeflow's int4-weight x int8-activation kernel (issue 21): the q4 layout and the row kernel behind
   mf_q4_linear and mf_q4_expert (native.c, whose comment states the numerics).

   Layout of a q4 matrix [N, K] (packed uint8 [N, K/2], s and m fp32 [N, K/group]): rows come in groups of 8.
   Group R (rows 8R .. 8R+7) is 8 * K/2 contiguous bytes; for each 32-feature block b, 128 bytes at b * 128 =
   four 32-byte vectors P0..P3, byte 4r + j of Pc holding row 8R+r's feature 32b + 8c + j in its low nibble and
   feature 32b + 8c + 4 + j in its high one (r < 8, j < 4). Its scales and mins likewise: s[8R * ng + 8g + r].
   The last N % 8 rows keep a plain row layout: row n at n * K/2, block b's byte j = q[32b + j] | q[32b+16+j] << 4,
   s[n * ng + g].
   Two forms of s and m (``fmt``): MF_Q4_F32: s and m fp32 (m = -zero * s); MF_Q4_F16Z: s fp16 and m the uint8
   zero points themselves, the kernel forming m = -(float)zero * (float)s, exactly the fp32 form's value when the
   scales are fp16 numbers (AWQ checkpoints' are): the same results bit for bit from 3 instead of 8 bytes per row
   and group (-7% of an int4 matrix's bytes at group 128).

   Group 32 with integer zero points (MF_Q4_F16Z at group 32, and MF_Q4_F16Z8): q4z.c's kernels (mf_q4z_rows).

   Why this layout: one maddubs (unsigned x signed bytes, adjacent pairs summed into int16) then multiplies 8
   rows x 4 features by one token's 4 activations broadcast to every row, so its 16 int16 sums stay 2 per row.
   A block's 8 maddubs add exactly in int16 (|sum| <= 32 * 15 * 127 / 2 = 30480 < 32767) and widen once per block
   for 8 rows, lanes = rows: no horizontal sums. The unpacked weights of a block are reused for a tile of up to
   TT tokens held in registers, the widening and scaling run once per token, block and 8 rows.

   Arithmetic per token per 8 rows x 32 features (128 weight bytes): 8 maddubs + 8 int16 adds + 8 activation
   broadcasts + 1 madd + 1 convert + 1 mul + 1 fma, and the block's unpacking (4 loads, 12 ops) over the tile. */

#include <stddef.h>
#include <string.h>

#include "native.h"

#define TT 4  /* tokens per register tile (3..8 measured alike; 4 keeps every accumulator in a register) */
/* bytes ahead of the block being read, into L2 (native.h's MF_Q4_PF_DIST, MF_Q4_PF_HINT; the next row group's when
   near the end of this one). Before s17 3072 into L1: 17.9 GB/s with 1024, 19.2-19.3 with 2048-4096 from one token
   on the 2-core EPYC (issue 21, s12); s17 measured L2 at 4-64 KB ~8 % faster than that (benchmarks/cpu/q4_cold.py) */
#define PREFETCH MF_Q4_PF_DIST

/* Scale and min of element i of a row group's (or a tail row's) s and m arrays, in either form. */
static inline float q4_scale(const void* s, int fmt, size_t i) {
    return fmt == MF_Q4_F16Z ? mf_half_to_float(((const uint16_t*)s)[i]) : ((const float*)s)[i];
}
static inline float q4_min(const void* s, const void* m, int fmt, size_t i) {
    return fmt == MF_Q4_F16Z ? -((float)((const uint8_t*)m)[i] * q4_scale(s, fmt, i)) : ((const float*)m)[i];
}

#if MF_AVX2
/* The 8 rows' scales and mins of group g (8 consecutive values each). */
static inline __attribute__((always_inline)) void q4_scales8(const void* s, const void* m, int fmt, int g,
                                                              __m256* sv, __m256* mv) {
    if (fmt == MF_Q4_F16Z) {
        *sv = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)((const uint16_t*)s + 8 * g)));
        const __m256 z = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)((const uint8_t*)m + 8 * g))));
        *mv = _mm256_xor_ps(_mm256_mul_ps(z, *sv), _mm256_set1_ps(-0.0f));
    } else {
        *sv = _mm256_loadu_ps((const float*)s + 8 * g);
        *mv = _mm256_loadu_ps((const float*)m + 8 * g);
    }
}

/* 8 grouped rows (w, s, m: this row group's bytes) against ``tt`` tokens from t0: y[t, n .. n + 8). */
static inline __attribute__((always_inline)) void q4_group_tile(
    const uint8_t* w, const void* s, const void* m, int fmt, int K, int group, const int8_t* xq, const float* xs,
    const float* gsum, int t0, int tt, float* y, int ldy, int n) {
    const int nb = K / QB, ng = K / group, bpg = group / QB;
    const __m256i low = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
    __m256 acc[TT];
    for (int i = 0; i < tt; i++) acc[i] = _mm256_setzero_ps();
    for (int g = 0; g < ng; g++) {
        __m256 sv, mv;
        q4_scales8(s, m, fmt, g, &sv, &mv);
        for (int i = 0; i < tt; i++)  /* the mins: m[n, g] * sum over the group of the token's activations */
            acc[i] = _mm256_fmadd_ps(mv, _mm256_broadcast_ss(gsum + (size_t)(t0 + i) * ng + g), acc[i]);
        for (int b = g * bpg; b < (g + 1) * bpg; b++) {
            const uint8_t* wb = w + (size_t)b * 128;
            _mm_prefetch((const char*)(wb + PREFETCH), MF_Q4_PF_HINT);
            _mm_prefetch((const char*)(wb + PREFETCH + 64), MF_Q4_PF_HINT);
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
                /* each step's sums in registers: else gcc reassociates the block's 32 products into one tree
                   and spills them (measured ~8% slower, as was a loop kept rolled) */
                for (int i = 0; i < tt; i++) __asm__("" : "+x"(dot[i]));
            }
            for (int i = 0; i < tt; i++) {
                const __m256 scale = _mm256_mul_ps(sv, _mm256_broadcast_ss(xs + (size_t)(t0 + i) * nb + b));
                acc[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_madd_epi16(dot[i], ones)), scale, acc[i]);
            }
        }
    }
    for (int i = 0; i < tt; i++) _mm256_storeu_ps(y + (size_t)(t0 + i) * ldy + n, acc[i]);
}

#if MF_AVX512
/* AVX-512 VNNI: one row group's block (128 bytes) as the AVX2 path reads it (one stream; its prefetch), its 8 row
   sums from 256-bit vpdpbusd on the broadcast activations (native.h's mf_q4_block_dots256, the AVX2 path's integers
   exactly; before s17 two 512-bit registers against permuted activations, folded: 8-30 % slower). The fp32 part is
   the AVX2 path's operations on the same 8 lanes, so the same bits. */
static inline __attribute__((always_inline)) void q4_group_tile512(
    const uint8_t* w, const void* s, const void* m, int fmt, int K, int group, const int8_t* xq, const float* xs,
    const float* gsum, int t0, int tt, float* y, int ldy, int n) {
    const int nb = K / QB, ng = K / group, bpg = group / QB;
    __m256 acc[TT];
    for (int i = 0; i < tt; i++) acc[i] = _mm256_setzero_ps();
    for (int g = 0; g < ng; g++) {
        __m256 sv, mv;
        q4_scales8(s, m, fmt, g, &sv, &mv);
        for (int i = 0; i < tt; i++)
            acc[i] = _mm256_fmadd_ps(mv, _mm256_broadcast_ss(gsum + (size_t)(t0 + i) * ng + g), acc[i]);
        MF_UNROLL(2)  /* two blocks per pass: -16-25 % at 1 token from the L2 cache, none from DRAM (s17) */
        for (int b = g * bpg; b < (g + 1) * bpg; b++) {
            const uint8_t* wb = w + (size_t)b * 128;
            _mm_prefetch((const char*)(wb + PREFETCH), MF_Q4_PF_HINT);
            _mm_prefetch((const char*)(wb + PREFETCH + 64), MF_Q4_PF_HINT);
            __m256i d8[TT];
            mf_q4_block_dots256(wb, xq, K, b, t0, tt, d8);
            for (int i = 0; i < tt; i++) {
                const __m256 scale = _mm256_mul_ps(sv, _mm256_broadcast_ss(xs + (size_t)(t0 + i) * nb + b));
                acc[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(d8[i]), scale, acc[i]);
            }
        }
    }
    for (int i = 0; i < tt; i++) _mm256_storeu_ps(y + (size_t)(t0 + i) * ldy + n, acc[i]);
}
#define Q4_TILE q4_group_tile512  /* the tile q4_group_fmt runs */

/* Several tokens (T >= Q4_PAIR_MIN_T per call): two row groups at once, 16 rows = the 16 lanes of a register
   (group A's 8 rows low, B's high; B's bytes 8 * K/2 after A's, its scales 8 * K/group after A's), the
   activations broadcast to every lane: ~0.8x the single group's compute per token (s17, from the L2 cache), so
   faster where the weights are reused over tokens; from memory at one token its two streams read slower than the
   single group's one (s17, from DRAM: 0.70 vs 0.77 of a plain read), hence the threshold (four tokens from DRAM:
   -8 %). Per row the same integers and fp32 operations as q4_group_tile512: the same bits. */
#define Q4_PAIR_MIN_T 4
static inline __attribute__((always_inline)) void q4_scales16(const void* s, const void* m, int fmt, size_t ab,
                                                               int g, __m512* sv, __m512* mv) {
    if (fmt == MF_Q4_F16Z) {
        const uint16_t* s16 = (const uint16_t*)s + 8 * g;
        const uint8_t* z8 = (const uint8_t*)m + 8 * g;
        *sv = _mm512_cvtph_ps(_mm256_inserti128_si256(_mm256_castsi128_si256(_mm_loadu_si128((const __m128i*)s16)),
                                                      _mm_loadu_si128((const __m128i*)(s16 + ab)), 1));
        const __m128i z = _mm_unpacklo_epi64(_mm_loadl_epi64((const __m128i*)z8),
                                             _mm_loadl_epi64((const __m128i*)(z8 + ab)));
        const __m512 zf = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(z));
        *mv = _mm512_castsi512_ps(_mm512_xor_si512(_mm512_castps_si512(_mm512_mul_ps(zf, *sv)),
                                                   _mm512_set1_epi32((int)0x80000000u)));
    } else {
        *sv = mf_load2x8ps((const float*)s + 8 * g, (const float*)s + ab + 8 * g);
        *mv = mf_load2x8ps((const float*)m + 8 * g, (const float*)m + ab + 8 * g);
    }
}

static inline __attribute__((always_inline)) void q4_pair_tile(
    const uint8_t* w, const void* s, const void* m, int fmt, int K, int group, const int8_t* xq, const float* xs,
    const float* gsum, int t0, int tt, float* y, int ldy, int n) {
    const int nb = K / QB, ng = K / group, bpg = group / QB;
    const size_t wb_off = (size_t)Q4_GROUP * K / 2, sm_off = (size_t)Q4_GROUP * ng;  /* group B after A */
    __m512 acc[TT];
    for (int i = 0; i < tt; i++) acc[i] = _mm512_setzero_ps();
    for (int g = 0; g < ng; g++) {
        __m512 sv, mv;
        q4_scales16(s, m, fmt, sm_off, g, &sv, &mv);
        for (int i = 0; i < tt; i++)
            acc[i] = _mm512_fmadd_ps(mv, _mm512_set1_ps(gsum[(size_t)(t0 + i) * ng + g]), acc[i]);
        for (int b = g * bpg; b < (g + 1) * bpg; b++) {
            const uint8_t* wa = w + (size_t)b * 128;
            __m512i dot[TT][4];  /* low, high nibbles of even, odd c: independent sums, added at the end (exact) */
            mf_q4_pair_block_dots(wa, wb_off, xq, K, b, t0, tt, dot);
            for (int i = 0; i < tt; i++) {
                const __m512i d = _mm512_add_epi32(_mm512_add_epi32(dot[i][0], dot[i][1]),
                                                   _mm512_add_epi32(dot[i][2], dot[i][3]));
                const __m512 scale = _mm512_mul_ps(sv, _mm512_set1_ps(xs[(size_t)(t0 + i) * nb + b]));
                acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(d), scale, acc[i]);
            }
        }
    }
    for (int i = 0; i < tt; i++) _mm512_storeu_ps(y + (size_t)(t0 + i) * ldy + n, acc[i]);
}

static inline __attribute__((always_inline)) void q4_pair_fmt(
    const uint8_t* w, const void* s, const void* m, int fmt, int T, int K, int group, const int8_t* xq,
    const float* xs, const float* gsum, float* y, int ldy, int n) {
    int t0 = 0;
    for (; t0 + TT <= T; t0 += TT) q4_pair_tile(w, s, m, fmt, K, group, xq, xs, gsum, t0, TT, y, ldy, n);
    switch (T - t0) {
        case 1: q4_pair_tile(w, s, m, fmt, K, group, xq, xs, gsum, t0, 1, y, ldy, n); break;
        case 2: q4_pair_tile(w, s, m, fmt, K, group, xq, xs, gsum, t0, 2, y, ldy, n); break;
        case 3: q4_pair_tile(w, s, m, fmt, K, group, xq, xs, gsum, t0, 3, y, ldy, n); break;
        default: break;
    }
}

/* Two consecutive row groups (rows n .. n + 16) against all T tokens. */
static void q4_group_pair(const uint8_t* w, const void* s, const void* m, int fmt, int T, int K, int group,
                          const int8_t* xq, const float* xs, const float* gsum, float* y, int ldy, int n) {
    if (fmt == MF_Q4_F16Z)
        q4_pair_fmt(w, s, m, MF_Q4_F16Z, T, K, group, xq, xs, gsum, y, ldy, n);
    else
        q4_pair_fmt(w, s, m, MF_Q4_F32, T, K, group, xq, xs, gsum, y, ldy, n);
}
#else
#define Q4_TILE q4_group_tile
#endif

/* One row group against all T tokens: tiles of TT tokens, then one tile of the remaining 1..TT-1 (constant
   tile sizes, so each is compiled with its accumulators in registers). */
static inline __attribute__((always_inline)) void q4_group_fmt(
    const uint8_t* w, const void* s, const void* m, int fmt, int T, int K, int group, const int8_t* xq,
    const float* xs, const float* gsum, float* y, int ldy, int n) {
    int t0 = 0;
    for (; t0 + TT <= T; t0 += TT) Q4_TILE(w, s, m, fmt, K, group, xq, xs, gsum, t0, TT, y, ldy, n);
    switch (T - t0) {
        case 1: Q4_TILE(w, s, m, fmt, K, group, xq, xs, gsum, t0, 1, y, ldy, n); break;
        case 2: Q4_TILE(w, s, m, fmt, K, group, xq, xs, gsum, t0, 2, y, ldy, n); break;
        case 3: Q4_TILE(w, s, m, fmt, K, group, xq, xs, gsum, t0, 3, y, ldy, n); break;
        default: break;
    }
}

static void q4_group(const uint8_t* w, const void* s, const void* m, int fmt, int T, int K, int group,
                     const int8_t* xq, const float* xs, const float* gsum, float* y, int ldy, int n) {
    if (fmt == MF_Q4_F16Z)  /* each form compiled on its own: the scales' loads are in the inner loop */
        q4_group_fmt(w, s, m, MF_Q4_F16Z, T, K, group, xq, xs, gsum, y, ldy, n);
    else
        q4_group_fmt(w, s, m, MF_Q4_F32, T, K, group, xq, xs, gsum, y, ldy, n);
}

#else
/* The portable loops over the same layout (machines without AVX2). */
static void q4_group(const uint8_t* w, const void* s, const void* m, int fmt, int T, int K, int group,
                     const int8_t* xq, const float* xs, const float* gsum, float* y, int ldy, int n) {
    const int nb = K / QB, ng = K / group, bpg = group / QB;
    for (int t = 0; t < T; t++) {
        const int8_t* xt = xq + (size_t)t * K;
        float acc[Q4_GROUP] = {0};
        for (int g = 0; g < ng; g++) {
            float ag[Q4_GROUP] = {0};
            for (int b = g * bpg; b < (g + 1) * bpg; b++) {
                int dot[Q4_GROUP] = {0};
                for (int c = 0; c < 4; c++)
                    for (int r = 0; r < Q4_GROUP; r++)
                        for (int j = 0; j < 4; j++) {
                            const uint8_t v = w[(size_t)b * 128 + 32 * c + 4 * r + j];
                            dot[r] += (v & 0xF) * xt[b * QB + 8 * c + j] + (v >> 4) * xt[b * QB + 8 * c + 4 + j];
                        }
                for (int r = 0; r < Q4_GROUP; r++) ag[r] += (float)dot[r] * xs[(size_t)t * nb + b];
            }
            for (int r = 0; r < Q4_GROUP; r++)
                acc[r] += ag[r] * q4_scale(s, fmt, 8 * g + r) + q4_min(s, m, fmt, 8 * g + r) * gsum[(size_t)t * ng + g];
        }
        for (int r = 0; r < Q4_GROUP; r++) y[(size_t)t * ldy + n + r] = acc[r];
    }
}
#endif

/* A tail row (plain row layout) against all T tokens. */
static void q4_tail_row(const uint8_t* row, const void* s, const void* m, int fmt, int T, int K, int group,
                        const int8_t* xq, const float* xs, const float* gsum, float* y, int ldy, int n) {
    const int nb = K / QB, ng = K / group, bpg = group / QB;
    for (int t = 0; t < T; t++) {
        const int8_t* xt = xq + (size_t)t * K;
        float a = 0.0f;
        for (int g = 0; g < ng; g++) {
            float ag = 0.0f;
            for (int b = g * bpg; b < (g + 1) * bpg; b++) {
                int dot = 0;
                for (int j = 0; j < QB / 2; j++)
                    dot += (row[b * 16 + j] & 0xF) * xt[b * QB + j] + (row[b * 16 + j] >> 4) * xt[b * QB + 16 + j];
                ag += (float)dot * xs[(size_t)t * nb + b];
            }
            a += ag * q4_scale(s, fmt, g) + q4_min(s, m, fmt, g) * gsum[(size_t)t * ng + g];
        }
        y[(size_t)t * ldy + n] = a;
    }
}

void mf_q4_rows(int n0, int n1, int T, int K, int group, int fmt, const uint8_t* qw, const void* s, const void* m,
                const int8_t* xq, const float* xs, const float* gsum, const int32_t* xsum, float* y, int ldy) {
    if (fmt == MF_Q4_F16Z8 || (fmt == MF_Q4_F16Z && group == QB)) {  /* group 32, integer zero points: q4z.c */
        mf_q4z_rows(n0, n1, T, K, fmt, qw, s, m, xq, xs, xsum, y, ldy);
        return;
    }
    const size_t ng = (size_t)(K / group), half = (size_t)(K / 2);
    const size_t ss = fmt == MF_Q4_F16Z ? 2 : 4, ms = fmt == MF_Q4_F16Z ? 1 : 4;  /* bytes per scale, per min */
    const char *sb = (const char*)s, *mb = (const char*)m;
    int n = n0;  /* n0 is a multiple of 8; rows past the last whole group only in the last call (n1 = N) */
#if MF_AVX512
    if (T >= Q4_PAIR_MIN_T)
        for (; n + 2 * Q4_GROUP <= n1; n += 2 * Q4_GROUP)
            q4_group_pair(qw + n * half, sb + n * ng * ss, mb + n * ng * ms, fmt, T, K, group, xq, xs, gsum, y,
                          ldy, n);
#endif
    for (; n + Q4_GROUP <= n1; n += Q4_GROUP)
        q4_group(qw + n * half, sb + n * ng * ss, mb + n * ng * ms, fmt, T, K, group, xq, xs, gsum, y, ldy, n);
    for (; n < n1; n++)
        q4_tail_row(qw + n * half, sb + n * ng * ss, mb + n * ng * ms, fmt, T, K, group, xq, xs, gsum, y, ldy, n);
}
