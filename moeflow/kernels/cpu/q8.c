/* moeflow's int8-weight x int8-activation kernel (issue 21): the q8 layout and the row kernel behind
   mf_q8_linear (native.c, whose comment states the numerics).

   Layout of a q8 matrix [N, K] (int8 [N, K] in [-127, 127], scales fp32 [N] in row order): rows come in groups
   of 8. Group R (rows 8R .. 8R+7) is 8 * K contiguous bytes; for each 32-feature block b, 256 bytes at b * 256 =
   eight 32-byte vectors V0..V7, byte 4r + j of Vc holding row 8R+r's feature 32b + 4c + j (r < 8, j < 4).
   The last N % 8 rows keep the plain row layout (row n at n * K). A checkpoint's rows are converted at load
   (native.py's Q8Matrix); a range of rows starting and ending at multiples of 8 (or at N) is a slice.

   Why this layout: maddubs (unsigned x signed bytes, adjacent pairs summed into int16) then multiplies 8 rows x
   4 features by one token's 4 activations broadcast to every row. It wants one unsigned operand: |w| times
   x with w's sign (vpsignb), exact since |w|, |x| <= 127 (a pair is at most 2 * 127 * 127 = 32258 < 32767).
   Each step's int16 pairs widen (madd by ones) into int32 lanes that are the 8 rows: a block's sum is exact in
   int32 and needs no horizontal sum; one convert and one fma per token, block and 8 rows apply the
   activation scale; the row scales multiply once per row group. The weights of a step serve a tile of up to
   TT tokens held in registers; one token (decode) takes two row groups at a time instead.

   Per token per 8 rows x 32 features (256 weight bytes): 8 x (broadcast, sign, maddubs, madd, add) + 1
   convert + 1 fma; per 256 bytes, shared by the tile: 8 loads and 8 vpsignb (|w|).
   Numerics: y[t, n] = s[n] * acc, acc = fma(float(block dot), xs[t, b], acc) over blocks b in order, block dots
   exact integers: every row and token the same operations whatever the tile, row group or batch (the plain
   tail rows and rows picked by index too, with fmaf: mf_q8_row), so a row's result is bit-identical however it
   is computed. */

#include <math.h>
#include <stddef.h>
#include <string.h>

#include "native.h"

#define TT 4           /* tokens per register tile: 4 dot + 4 fp32 accumulators, with |w|, w and the ones */
#ifndef PREFETCH
#define PREFETCH 4096  /* bytes ahead of the block being read, per row group (16 blocks) */
#endif
#ifndef PREFETCH512
/* the AVX-512 pair tile's distance: at K = 1024 the same block of the next pair (16 KB ahead); measured cold on
   Zen 4 at one thread, 32 MB int8 heads of K = 1024 / 4096: 14-15 -> 17.7-18.0 / 18.0-18.9 -> 18.3-19.7 GB/s
   against 4096 (16384: between the two) */
#define PREFETCH512 8192
#endif

#if MF_AVX2
/* ``ng`` consecutive row groups (w, s: their bytes and scales; 8 * K bytes each) against ``tt`` tokens from t0:
   y[t, n .. n + 8 ng). Two groups serve one token (T = 1: two streams 8 K bytes apart keep more of the memory's
   bandwidth busy than one, measured 9-50% faster from memory), one group a tile of up to TT tokens. */
static inline __attribute__((always_inline)) void q8_tile(
    const int8_t* w, const float* s, int K, const int8_t* xq, const float* xs, int t0, int ng, int tt, float* y,
    int ldy, int n) {
    const int nb = K / QB;
    const size_t gs = (size_t)Q8_GROUP * K;
    const __m256i ones = _mm256_set1_epi16(1);
    __m256 acc[2][TT];
    for (int g = 0; g < ng; g++)
        for (int i = 0; i < tt; i++) acc[g][i] = _mm256_setzero_ps();
    for (int b = 0; b < nb; b++) {
        const int8_t* wb = w + (size_t)b * 256;
        for (int g = 0; g < ng; g++)
            for (int l = 0; l < 256; l += 64) _mm_prefetch((const char*)(wb + g * gs + PREFETCH + l), _MM_HINT_T0);
        __m256i dot[2][TT];
        for (int g = 0; g < ng; g++)
            for (int i = 0; i < tt; i++) dot[g][i] = _mm256_setzero_si256();
        for (int c = 0; c < 8; c++) {
            for (int g = 0; g < ng; g++) {
                const __m256i v = _mm256_loadu_si256((const __m256i*)(wb + g * gs + 32 * c));
                const __m256i a = _mm256_sign_epi8(v, v);
                for (int i = 0; i < tt; i++) {
                    const __m256i xv = _mm256_sign_epi8(bcast4(xq + (size_t)(t0 + i) * K + b * QB + 4 * c), v);
                    dot[g][i] = _mm256_add_epi32(dot[g][i], _mm256_madd_epi16(_mm256_maddubs_epi16(a, xv), ones));
                }
            }
            /* each step's sums in registers (else gcc adds the block's 8 steps as a tree and spills them) */
            if (tt > 1)
                for (int i = 0; i < tt; i++) __asm__("" : "+x"(dot[0][i]));
        }
        for (int g = 0; g < ng; g++)
            for (int i = 0; i < tt; i++)
                acc[g][i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot[g][i]),
                                            _mm256_broadcast_ss(xs + (size_t)(t0 + i) * nb + b), acc[g][i]);
    }
    for (int g = 0; g < ng; g++) {
        const __m256 sv = _mm256_loadu_ps(s + 8 * g);
        for (int i = 0; i < tt; i++)
            _mm256_storeu_ps(y + (size_t)(t0 + i) * ldy + n + 8 * g, _mm256_mul_ps(sv, acc[g][i]));
    }
}

/* One row group against all T tokens: tiles of TT tokens, then one tile of the remaining 1..TT-1 (constant
   tile sizes, so each is compiled with its accumulators in registers). */
static void q8_group(const int8_t* w, const float* s, int T, int K, const int8_t* xq, const float* xs, float* y,
                     int ldy, int n) {
    int t0 = 0;
    for (; t0 + TT <= T; t0 += TT) q8_tile(w, s, K, xq, xs, t0, 1, TT, y, ldy, n);
    switch (T - t0) {
        case 1: q8_tile(w, s, K, xq, xs, t0, 1, 1, y, ldy, n); break;
        case 2: q8_tile(w, s, K, xq, xs, t0, 1, 2, y, ldy, n); break;
        case 3: q8_tile(w, s, K, xq, xs, t0, 1, 3, y, ldy, n); break;
        default: break;
    }
}

#if MF_AVX512
/* AVX-512 VNNI: two row groups at once, 16 rows = the 16 lanes of a register (group A's 8 rows low, B's high,
   B's bytes 8 * K after A's; the scales are in row order). vpdpbusd wants one unsigned operand, as maddubs:
   |w| (vpabsb, once per weight vector) times x with w's sign (x negated where w < 0: a masked subtract per
   token; AVX-512 has no vpsignb), exact. The block sums are the AVX2 path's integers, then the same convert,
   fma and final scale product per row: the same bits. */
static inline __attribute__((always_inline)) void q8_pair_tile(
    const int8_t* w, const float* s, int K, const int8_t* xq, const float* xs, int t0, int tt, float* y, int ldy,
    int n) {
    const int nb = K / QB;
    const size_t gs = (size_t)Q8_GROUP * K;
    const __m512i zero = _mm512_setzero_si512();
    __m512 acc[TT];
    for (int i = 0; i < tt; i++) acc[i] = _mm512_setzero_ps();
    for (int b = 0; b < nb; b++) {
        const int8_t* wb = w + (size_t)b * 256;
        size_t pf = (size_t)b * 256 + PREFETCH512;  /* as q4.c's pairs: into the next pair's same group */
        pf += pf >= gs ? gs : 0;
        for (int l = 0; l < 256; l += 64) {
            _mm_prefetch((const char*)(w + pf + l), _MM_HINT_T0);
            _mm_prefetch((const char*)(w + gs + pf + l), _MM_HINT_T0);
        }
        __m512i dot[TT][4];  /* four independent sums per token (c mod 4), added at the end: exact, off one chain */
        for (int i = 0; i < tt; i++)
            for (int a = 0; a < 4; a++) dot[i][a] = _mm512_setzero_si512();
        for (int c = 0; c < 8; c++) {
            const __m512i v = mf_load2x256(wb + 32 * c, wb + gs + 32 * c);
            const __m512i a = _mm512_abs_epi8(v);
            const __mmask64 neg = _mm512_movepi8_mask(v);
            for (int i = 0; i < tt; i++) {
                int32_t x4;
                memcpy(&x4, xq + (size_t)(t0 + i) * K + b * QB + 4 * c, 4);
                const __m512i xb = _mm512_set1_epi32(x4);
                dot[i][c & 3] = _mm512_dpbusd_epi32(dot[i][c & 3], a, _mm512_mask_sub_epi8(xb, neg, zero, xb));
            }
        }
        for (int i = 0; i < tt; i++) {
            const __m512i d = _mm512_add_epi32(_mm512_add_epi32(dot[i][0], dot[i][1]),
                                               _mm512_add_epi32(dot[i][2], dot[i][3]));
            acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(d), _mm512_set1_ps(xs[(size_t)(t0 + i) * nb + b]), acc[i]);
        }
    }
    const __m512 sv = _mm512_loadu_ps(s);
    for (int i = 0; i < tt; i++) _mm512_storeu_ps(y + (size_t)(t0 + i) * ldy + n, _mm512_mul_ps(sv, acc[i]));
}

/* Two row groups (rows n .. n + 16) against all T tokens (w, s: their bytes and scales). */
static void q8_group_pair(const int8_t* w, const float* s, int T, int K, const int8_t* xq, const float* xs,
                          float* y, int ldy, int n) {
    int t0 = 0;
    for (; t0 + TT <= T; t0 += TT) q8_pair_tile(w, s, K, xq, xs, t0, TT, y, ldy, n);
    switch (T - t0) {
        case 1: q8_pair_tile(w, s, K, xq, xs, t0, 1, y, ldy, n); break;
        case 2: q8_pair_tile(w, s, K, xq, xs, t0, 2, y, ldy, n); break;
        case 3: q8_pair_tile(w, s, K, xq, xs, t0, 3, y, ldy, n); break;
        default: break;
    }
}
#else
/* Two row groups against one token. */
static void q8_group_pair(const int8_t* w, const float* s, int T, int K, const int8_t* xq, const float* xs,
                          float* y, int ldy, int n) {
    (void)T;
    q8_tile(w, s, K, xq, xs, 0, 2, 1, y, ldy, n);
}
#endif
#else
/* The portable loops over the same layout (machines without AVX2). */
static void q8_group(const int8_t* w, const float* s, int T, int K, const int8_t* xq, const float* xs, float* y,
                     int ldy, int n) {
    const int nb = K / QB;
    for (int t = 0; t < T; t++) {
        const int8_t* xt = xq + (size_t)t * K;
        float acc[Q8_GROUP] = {0};
        for (int b = 0; b < nb; b++) {
            int dot[Q8_GROUP] = {0};
            for (int c = 0; c < 8; c++)
                for (int r = 0; r < Q8_GROUP; r++)
                    for (int j = 0; j < 4; j++) dot[r] += w[(size_t)b * 256 + 32 * c + 4 * r + j] * xt[b * QB + 4 * c + j];
            for (int r = 0; r < Q8_GROUP; r++) acc[r] = fmaf((float)dot[r], xs[(size_t)t * nb + b], acc[r]);
        }
        for (int r = 0; r < Q8_GROUP; r++) y[(size_t)t * ldy + n + r] = s[r] * acc[r];
    }
}

static void q8_group_pair(const int8_t* w, const float* s, int T, int K, const int8_t* xq, const float* xs,
                          float* y, int ldy, int n) {
    for (int g = 0; g < 2; g++) q8_group(w + (size_t)g * Q8_GROUP * K, s + 8 * g, T, K, xq, xs, y, ldy, n + 8 * g);
}
#endif

/* Row n of a q8 matrix [N, K] against all T tokens, y[t * ldy]: the operations of a grouped row's lane, read
   from either layout (a plain tail row; a few rows picked by index, mf_q8_linear_rows). */
void mf_q8_row(int n, int N, int T, int K, const int8_t* w, const float* s, const int8_t* xq, const float* xs,
               float* y, int ldy) {
    const int nb = K / QB, grouped = n < N - N % Q8_GROUP;
    /* feature 32b + 4c + j at row + b * bstride + c * cstride + j */
    const int8_t* row = grouped ? w + (size_t)(n / Q8_GROUP) * Q8_GROUP * K + 4 * (n % Q8_GROUP) : w + (size_t)n * K;
    const int bstride = grouped ? 256 : QB, cstride = grouped ? 32 : 4;
    for (int t = 0; t < T; t++) {
        const int8_t* xt = xq + (size_t)t * K;
        float acc = 0.0f;
        for (int b = 0; b < nb; b++) {
            int dot = 0;
            for (int c = 0; c < 8; c++)
                for (int j = 0; j < 4; j++) dot += row[b * bstride + c * cstride + j] * xt[b * QB + 4 * c + j];
            acc = fmaf((float)dot, xs[(size_t)t * nb + b], acc);
        }
        y[(size_t)t * ldy] = s[n] * acc;
    }
}

void mf_q8_rows(int n0, int n1, int T, int K, const int8_t* w, const float* s, const int8_t* xq, const float* xs,
                float* y, int ldy) {
    int n = n0;  /* n0 is a multiple of 8; rows past the last whole group only in the last call (n1 = N) */
    if (T == 1 || MF_AVX512)  /* two groups per call: AVX2 for one token, AVX-512 for any */
        for (; n + 2 * Q8_GROUP <= n1; n += 2 * Q8_GROUP)
            q8_group_pair(w + (size_t)n * K, s + n, T, K, xq, xs, y, ldy, n);
    for (; n + Q8_GROUP <= n1; n += Q8_GROUP) q8_group(w + (size_t)n * K, s + n, T, K, xq, xs, y, ldy, n);
    for (; n < n1; n++) mf_q8_row(n, n1, T, K, w, s, xq, xs, y + n, ldy);  /* here n1 = N */
}
