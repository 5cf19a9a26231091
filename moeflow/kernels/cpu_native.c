/* moeflow's CPU matrix kernels: 4-bit and 8-bit weights times int8-quantized activations (issue 21).

   Built on first use by moeflow/kernels/cpu_native.py (gcc/cc, -O3 -march=native -fopenmp) and called through
   ctypes; cpu_native.py holds the plain-torch fp32 model of every function here.

   Activations x fp32 [T, K] are quantized per token and per block of 32 features: xs = max|x| / 127,
   xq = round-half-even(x * (127 / max|x|)), int8 in [-127, 127].
   q4 weights: W[n, k] = q[n, k] * s[n, g] + m[n, g] with q in [0, 15] and g = k / group (AWQ's asymmetric
   format with the zero folded into m = -zero * s). Packed uint8 [N, K/2], s, m fp32 [N, K/group], rows
   interleaved in groups of 8 (layout and kernel in cpu_q4.c).
   q8 weights: W[n, k] = q[n, k] * s[n], int8 [N, K] in [-127, 127], s fp32 [N], rows interleaved in groups of
   8 (layout and kernel in cpu_q8.c).
   y[t, n] = sum_k xs[t, k/32] * xq[t, k] * W[n, k], accumulated in int32 per block and in fp32 across blocks.
   Every output element depends only on its own token's row: results do not change with the batch. */

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_native.h"

#define ROWS 16   /* weight rows per parallel work item (a multiple of Q4_GROUP and Q8_GROUP) */

int mf_simd(void) { return MF_AVX2; }

/* x fp32 [K] -> xq int8 [K], xs fp32 [K/32]; gsum fp32 [K/group] = sum over the group of xq * xs. */
static void quantize_row(const float* x, int K, int group, int8_t* xq, float* xs, float* gsum) {
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
        if (gsum) {
            if (b % bpg == 0) gsum[b / bpg] = 0.0f;
            gsum[b / bpg] += (float)sum * xs[b];
        }
    }
}

static void quantize_rows(const float* x, int T, int K, int group, int8_t* xq, float* xs, float* gsum, int nthreads) {
    int nb = K / QB, ng = group ? K / group : 0;
#pragma omp parallel for num_threads(nthreads) schedule(static) if (T * K >= 65536)
    for (int t = 0; t < T; t++)
        quantize_row(x + (size_t)t * K, K, group ? group : K, xq + (size_t)t * K, xs + (size_t)t * nb,
                     gsum ? gsum + (size_t)t * ng : NULL);
}

static int nchunks(int N) { return (N + ROWS - 1) / ROWS; }

/* y fp32 [T, N] = x fp32 [T, K] @ W.T for a q4 matrix (see the file comment). Returns 0, or -1 when out of memory. */
int mf_q4_linear(const float* x, int T, int K, int N, int group, const uint8_t* qw, const float* s, const float* m,
                 float* y, int nthreads) {
    int8_t* xq = malloc((size_t)T * K);
    float* xs = malloc(sizeof(float) * ((size_t)T * (K / QB) + (size_t)T * (K / group)));
    if (!xq || !xs) { free(xq); free(xs); return -1; }
    float* gsum = xs + (size_t)T * (K / QB);
    quantize_rows(x, T, K, group, xq, xs, gsum, nthreads);
#pragma omp parallel for num_threads(nthreads) schedule(static)
    for (int c = 0; c < nchunks(N); c++) {
        int n1 = (c + 1) * ROWS < N ? (c + 1) * ROWS : N;
        mf_q4_rows(c * ROWS, n1, T, K, group, qw, s, m, xq, xs, gsum, y, N);
    }
    free(xq); free(xs);
    return 0;
}

/* y fp32 [T, N] = x fp32 [T, K] @ W.T for a q8 matrix (see the file comment). */
int mf_q8_linear(const float* x, int T, int K, int N, const int8_t* w, const float* s, float* y, int nthreads) {
    int8_t* xq = malloc((size_t)T * K);
    float* xs = malloc(sizeof(float) * (size_t)T * (K / QB));
    if (!xq || !xs) { free(xq); free(xs); return -1; }
    quantize_rows(x, T, K, 0, xq, xs, NULL, nthreads);
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
    quantize_rows(x, T, K, 0, xq, xs, NULL, 1);
    for (int i = 0; i < nids; i++) mf_q8_row((int)ids[i], N, T, K, w, s, xq, xs, y + i, nids);
    free(xq); free(xs);
    return 0;
}

/* One SwiGLU expert on T tokens: h = x @ W13.T ([T, 2I], gate then up), a = silu(h[:, :I]) * h[:, I:],
   out[t] (+)= weight[t] * (a @ W2.T)[t]; ``accumulate`` adds into out instead of overwriting it.
   x fp32 [T, H]; W13 q4 [2I, H]; W2 q4 [H, I]; weight fp32 [T]; out fp32 [T, H]. */
int mf_q4_expert(const float* x, int T, int H, int I, int group,
                 const uint8_t* w13, const float* s13, const float* m13,
                 const uint8_t* w2, const float* s2, const float* m2,
                 const float* weight, float* out, int accumulate, int nthreads) {
    size_t kmax = (size_t)(H > I ? H : I);
    int8_t* xq = malloc((size_t)T * kmax);
    float* f = malloc(sizeof(float) * ((size_t)T * 3 * I + (size_t)T * H + 2 * (size_t)T * (kmax / QB)));
    if (!xq || !f) { free(xq); free(f); return -1; }
    float* h = f;                        /* [T, 2I] */
    float* a = h + (size_t)T * 2 * I;    /* [T, I] */
    float* y = a + (size_t)T * I;        /* [T, H] */
    float* xs = y + (size_t)T * H;       /* [T, kmax/32] */
    float* gsum = xs + (size_t)T * (kmax / QB);
    quantize_rows(x, T, H, group, xq, xs, gsum, nthreads);
#pragma omp parallel num_threads(nthreads)
    {
#pragma omp for schedule(static)
        for (int c = 0; c < nchunks(2 * I); c++) {
            int n1 = (c + 1) * ROWS < 2 * I ? (c + 1) * ROWS : 2 * I;
            mf_q4_rows(c * ROWS, n1, T, H, group, w13, s13, m13, xq, xs, gsum, h, 2 * I);
        }
#pragma omp for schedule(static)
        for (int t = 0; t < T; t++) {
            const float* ht = h + (size_t)t * 2 * I;
            float* at = a + (size_t)t * I;
            for (int i = 0; i < I; i++) {
                float g = ht[i];
                at[i] = g / (1.0f + expf(-g)) * ht[I + i];
            }
        }
    }
    quantize_rows(a, T, I, group, xq, xs, gsum, nthreads);
#pragma omp parallel for num_threads(nthreads) schedule(static)
    for (int c = 0; c < nchunks(H); c++) {
        int n1 = (c + 1) * ROWS < H ? (c + 1) * ROWS : H;
        mf_q4_rows(c * ROWS, n1, T, I, group, w2, s2, m2, xq, xs, gsum, y, H);
        for (int t = 0; t < T; t++)
            for (int n = c * ROWS; n < n1; n++) {
                float v = weight[t] * y[(size_t)t * H + n];
                out[(size_t)t * H + n] = accumulate ? out[(size_t)t * H + n] + v : v;
            }
    }
    free(xq); free(f);
    return 0;
}
