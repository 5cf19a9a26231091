/* moeflow's CPU matrix kernels: 4-bit and 8-bit weights times int8-quantized activations (issue 21).

   Built on first use by moeflow/kernels/cpu/native.py (gcc/cc, -O3 -march=native -fopenmp) and called through
   ctypes; native.py holds the plain-torch fp32 model of every function here.

   Activations x fp32 [T, K] are quantized per token and per block of 32 features: xs = max|x| / 127,
   xq = round-half-even(x * (127 / max|x|)), int8 in [-127, 127].
   q4 weights: W[n, k] = q[n, k] * s[n, g] + m[n, g] with q in [0, 15] and g = k / group (AWQ's asymmetric
   format with the zero folded into m = -zero * s). Packed uint8 [N, K/2], s, m fp32 [N, K/group] (MF_Q4_F32),
   or s fp16 and the uint8 zeros in m's place (MF_Q4_F16Z: the same numbers), or s fp16 and every zero 8, m unused
   (MF_Q4_F16Z8: GGUF's Q4_0, group 32), rows interleaved in groups of 8 (layout and kernel in q4.c; at group 32
   the integer zeros are folded into the block sums, with xsum: each block's sum of xq).
   q8 weights: W[n, k] = q[n, k] * s[n], int8 [N, K] in [-127, 127], s fp32 [N], rows interleaved in groups of
   8 (layout and kernel in q8.c).
   y[t, n] = sum_k xs[t, k/32] * xq[t, k] * W[n, k], accumulated in int32 per block and in fp32 across blocks.
   Every output element depends only on its own token's row: results do not change with the batch. */

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "native.h"

#define ROWS MF_ROWS  /* weight rows per parallel work item (native.h) */

/* The vector path built: 2 AVX-512 VNNI (q4.c's and q8.c's q4_group_pair, q8_group_pair), 1 AVX2,
   0 the portable loops. */
int mf_simd(void) { return MF_AVX512 ? 2 : MF_AVX2; }

#if MF_AVX2
/* glibc's __exp2f_data.tab: 2^(i/32) as double bits, minus i << 47 (mf_exp8) */
const uint64_t mf_exp2f_tab[32] = {
    0x3ff0000000000000, 0x3fefd9b0d3158574, 0x3fefb5586cf9890f, 0x3fef9301d0125b51, 0x3fef72b83c7d517b,
    0x3fef54873168b9aa, 0x3fef387a6e756238, 0x3fef1e9df51fdee1, 0x3fef06fe0a31b715, 0x3feef1a7373aa9cb,
    0x3feedea64c123422, 0x3feece086061892d, 0x3feebfdad5362a27, 0x3feeb42b569d4f82, 0x3feeab07dd485429,
    0x3feea47eb03a5585, 0x3feea09e667f3bcd, 0x3fee9f75e8ec5f74, 0x3feea11473eb0187, 0x3feea589994cce13,
    0x3feeace5422aa0db, 0x3feeb737b0cdc5e5, 0x3feec49182a3f090, 0x3feed503b23e255d, 0x3feee89f995ad3ad,
    0x3feeff76f2fb5e47, 0x3fef199bdd85529c, 0x3fef3720dcef9069, 0x3fef5818dcfba487, 0x3fef7c97337b9b5f,
    0x3fefa4afa2a490da, 0x3fefd0765b6e4540};
#endif

/* out[i] = silu(g[i]) * u[i] = g / (1 + expf(-g)) * u for n features: the same float operations in both paths
   (mf_exp8 is libm's expf bit for bit), 8 at a time with AVX2. */
void mf_silu_mul(const float* g, const float* u, int n, float* out) {
    int i = 0;
#if MF_AVX2
    const __m256 one = _mm256_set1_ps(1.0f), sign = _mm256_set1_ps(-0.0f);
    for (; i + 8 <= n; i += 8) {
        const __m256 gv = _mm256_loadu_ps(g + i);
        const __m256 e = mf_exp8(_mm256_xor_ps(gv, sign));
        _mm256_storeu_ps(out + i, _mm256_mul_ps(_mm256_div_ps(gv, _mm256_add_ps(one, e)), _mm256_loadu_ps(u + i)));
    }
#endif
    for (; i < n; i++) out[i] = g[i] / (1.0f + expf(-g[i])) * u[i];
}

/* The scalar loop of mf_silu_mul with libm's expf (tests compare the two bit for bit). */
void mf_silu_mul_scalar(const float* g, const float* u, int n, float* out) {
    for (int i = 0; i < n; i++) out[i] = g[i] / (1.0f + expf(-g[i])) * u[i];
}

/* x fp32 [K] -> xq int8 [K], xs fp32 [K/32]; gsum fp32 [K/group] = sum over the group of xq * xs; xsum int32
   [K/32] (when not NULL) = each block's sum of xq (exact: the group-32 q4 kernels fold the zero points in there).
   xq and xs do not depend on ``group``, gsum and xsum. (Also step_region.c's, per thread.) */
void mf_quantize_row(const float* x, int K, int group, int8_t* xq, float* xs, float* gsum, int32_t* xsum) {
    int nb = K / QB, bpg = group / QB;
    for (int b = 0; b < nb; b++) {
        const float* xb = x + b * QB;
        float amax = 0.0f;
        int sum = 0;
#if MF_AVX2  /* the same numbers as the loops below: max, one product, round half to even */
        __m256 v[4], mx = _mm256_setzero_ps();
        for (int i = 0; i < 4; i++) {
            v[i] = _mm256_loadu_ps(xb + 8 * i);
            mx = _mm256_max_ps(_mm256_andnot_ps(_mm256_set1_ps(-0.0f), v[i]), mx);
        }
        __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(mx), _mm256_extractf128_ps(mx, 1));
        m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
        amax = _mm_cvtss_f32(_mm_max_ss(m4, _mm_movehdup_ps(m4)));
        const __m256 inv = _mm256_set1_ps(amax > 0.0f ? 127.0f / amax : 0.0f);
        __m256i q[4];
        for (int i = 0; i < 4; i++)
            q[i] = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(v[i], inv),
                                                      _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
        const __m256i packed = _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]), _mm256_packs_epi32(q[2], q[3]));
        _mm256_storeu_si256((__m256i*)(xq + b * QB),
                            _mm256_permutevar8x32_epi32(packed, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
        __m256i s8 = _mm256_add_epi32(_mm256_add_epi32(q[0], q[1]), _mm256_add_epi32(q[2], q[3]));
        __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(s8), _mm256_extracti128_si256(s8, 1));
        s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0x4E));
        sum = _mm_cvtsi128_si32(_mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0xB1)));
#else
        for (int i = 0; i < QB; i++) amax = fmaxf(amax, fabsf(xb[i]));
        float inv = amax > 0.0f ? 127.0f / amax : 0.0f;
        for (int i = 0; i < QB; i++) {
            int q = (int)nearbyintf(xb[i] * inv);
            xq[b * QB + i] = (int8_t)q;
            sum += q;
        }
#endif
        xs[b] = amax / 127.0f;
        if (xsum) xsum[b] = sum;
        if (gsum) {
            if (b % bpg == 0) gsum[b / bpg] = 0.0f;
            gsum[b / bpg] += (float)sum * xs[b];
        }
    }
}

static void quantize_rows(const float* x, int T, int K, int group, int8_t* xq, float* xs, float* gsum,
                          int32_t* xsum, int nthreads) {
    int nb = K / QB, ng = group ? K / group : 0;
#pragma omp parallel for num_threads(nthreads) schedule(static) if (T * K >= 65536)
    for (int t = 0; t < T; t++)
        mf_quantize_row(x + (size_t)t * K, K, group ? group : K, xq + (size_t)t * K, xs + (size_t)t * nb,
                     gsum ? gsum + (size_t)t * ng : NULL, xsum ? xsum + (size_t)t * nb : NULL);
}

static int nchunks(int N) { return (N + ROWS - 1) / ROWS; }

/* y fp32 [T, N] = x fp32 [T, K] @ W.T for a q4 matrix (see the file comment). Returns 0, or -1 when out of memory. */
int mf_q4_linear(const float* x, int T, int K, int N, int group, int fmt, const uint8_t* qw, const void* s,
                 const void* m, float* y, int nthreads) {
    int8_t* xq = malloc((size_t)T * K);
    float* xs = malloc(sizeof(float) * ((size_t)T * (K / QB) * 2 + (size_t)T * (K / group)));
    if (!xq || !xs) { free(xq); free(xs); return -1; }
    int32_t* xsum = (int32_t*)(xs + (size_t)T * (K / QB));
    float* gsum = xs + (size_t)T * (K / QB) * 2;
    quantize_rows(x, T, K, group, xq, xs, gsum, xsum, nthreads);
#pragma omp parallel for num_threads(nthreads) schedule(static)
    for (int c = 0; c < nchunks(N); c++) {
        int n1 = (c + 1) * ROWS < N ? (c + 1) * ROWS : N;
        mf_q4_rows(c * ROWS, n1, T, K, group, fmt, qw, s, m, xq, xs, gsum, xsum, y, N);
    }
    free(xq); free(xs);
    return 0;
}

/* y fp32 [T, N] = x fp32 [T, K] @ W.T for a q8 matrix (see the file comment). */
int mf_q8_linear(const float* x, int T, int K, int N, const int8_t* w, const float* s, float* y, int nthreads) {
    int8_t* xq = malloc((size_t)T * K);
    float* xs = malloc(sizeof(float) * (size_t)T * (K / QB));
    if (!xq || !xs) { free(xq); free(xs); return -1; }
    quantize_rows(x, T, K, 0, xq, xs, NULL, NULL, nthreads);
#pragma omp parallel for num_threads(nthreads) schedule(static)
    for (int c = 0; c < nchunks(N); c++) {
        int n1 = (c + 1) * ROWS < N ? (c + 1) * ROWS : N;
        mf_q8_rows(c * ROWS, n1, T, K, w, s, xq, xs, y, N);
    }
    free(xq); free(xs);
    return 0;
}

/* y fp32 [T, nids] = x fp32 [T, K] @ W[ids].T for rows ids int64 [nids] of a q8 matrix [N, K]: each the same
   numbers as that row's column of mf_q8_linear (the int4 lm_head's recomputed candidates). */
int mf_q8_linear_rows(const float* x, int T, int K, int N, const int8_t* w, const float* s, const int64_t* ids,
                      int nids, float* y) {
    int8_t* xq = malloc((size_t)T * K);
    float* xs = malloc(sizeof(float) * (size_t)T * (K / QB));
    if (!xq || !xs) { free(xq); free(xs); return -1; }
    quantize_rows(x, T, K, 0, xq, xs, NULL, NULL, 1);
    for (int i = 0; i < nids; i++) mf_q8_row((int)ids[i], N, T, K, w, s, xq, xs, y + i, nids);
    free(xq); free(xs);
    return 0;
}

/* One SwiGLU expert on T tokens: h = x @ W13.T ([T, 2I], gate then up), a = silu(h[:, :I]) * h[:, I:],
   out[t] (+)= weight[t] * (a @ W2.T)[t]; ``accumulate`` adds into out instead of overwriting it.
   x fp32 [T, H]; W13 q4 [2I, H]; W2 q4 [H, I] (both in the form ``fmt``); weight fp32 [T]; out fp32 [T, H]. */
int mf_q4_expert(const float* x, int T, int H, int I, int group, int fmt,
                 const uint8_t* w13, const void* s13, const void* m13,
                 const uint8_t* w2, const void* s2, const void* m2,
                 const float* weight, float* out, int accumulate, int nthreads) {
    size_t kmax = (size_t)(H > I ? H : I);
    int8_t* xq = malloc((size_t)T * kmax);
    float* f = malloc(sizeof(float) * ((size_t)T * 3 * I + (size_t)T * H + 3 * (size_t)T * (kmax / QB)));
    if (!xq || !f) { free(xq); free(f); return -1; }
    float* h = f;                        /* [T, 2I] */
    float* a = h + (size_t)T * 2 * I;    /* [T, I] */
    float* y = a + (size_t)T * I;        /* [T, H] */
    float* xs = y + (size_t)T * H;       /* [T, kmax/32] */
    float* gsum = xs + (size_t)T * (kmax / QB);
    int32_t* xsum = (int32_t*)(gsum + (size_t)T * (kmax / QB));  /* [T, kmax/32] */
    quantize_rows(x, T, H, group, xq, xs, gsum, xsum, nthreads);
#pragma omp parallel num_threads(nthreads)
    {
#pragma omp for schedule(static)
        for (int c = 0; c < nchunks(2 * I); c++) {
            int n1 = (c + 1) * ROWS < 2 * I ? (c + 1) * ROWS : 2 * I;
            mf_q4_rows(c * ROWS, n1, T, H, group, fmt, w13, s13, m13, xq, xs, gsum, xsum, h, 2 * I);
        }
#pragma omp for schedule(static)
        for (int t = 0; t < T; t++) mf_silu_mul(h + (size_t)t * 2 * I, h + (size_t)t * 2 * I + I, I, a + (size_t)t * I);
    }
    quantize_rows(a, T, I, group, xq, xs, gsum, xsum, nthreads);
#pragma omp parallel for num_threads(nthreads) schedule(static)
    for (int c = 0; c < nchunks(H); c++) {
        int n1 = (c + 1) * ROWS < H ? (c + 1) * ROWS : H;
        mf_q4_rows(c * ROWS, n1, T, I, group, fmt, w2, s2, m2, xq, xs, gsum, xsum, y, H);
        for (int t = 0; t < T; t++)
            for (int n = c * ROWS; n < n1; n++) {
                float v = weight[t] * y[(size_t)t * H + n];
                out[(size_t)t * H + n] = accumulate ? out[(size_t)t * H + n] + v : v;
            }
    }
    free(xq); free(f);
    return 0;
}
