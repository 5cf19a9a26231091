/* moeflow's CPU matrix kernels: 4-bit and 8-bit weights times int8-quantized activations (issue 21).

   Built on first use by moeflow/kernels/cpu_native.py (gcc/cc, -O3 -march=native -fopenmp) and called through
   ctypes; cpu_native.py holds the plain-torch fp32 model of every function here.

   Activations x fp32 [T, K] are quantized per token and per block of 32 features: xs = max|x| / 127,
   xq = round-half-even(x * (127 / max|x|)), int8 in [-127, 127].
   q4 weights: W[n, k] = q[n, k] * s[n, g] + m[n, g] with q in [0, 15] and g = k / group (AWQ's asymmetric
   format with the zero folded into m = -zero * s). Packed uint8 [N, K/2]: within each block of 32 features
   byte j holds feature j in its low nibble and feature 16 + j in its high one. s, m fp32 [N, K/group].
   q8 weights: W[n, k] = q[n, k] * s[n], int8 [N, K] in [-127, 127], s fp32 [N].
   y[t, n] = sum_k xs[t, k/32] * xq[t, k] * W[n, k], accumulated in int32 per block and in fp32 across blocks.
   Every output element depends only on its own token's row: results do not change with the batch. */

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define MF_AVX2 1
#else
#define MF_AVX2 0
#endif

#define QB 32     /* features per activation block */
#define TILE 4    /* tokens computed together per weight row (the row's unpacked block is reused) */
#define ROWS 16   /* weight rows per parallel work item */
#define PREFETCH_ROWS 8  /* software prefetch this many rows ahead */

int mf_simd(void) { return MF_AVX2; }

/* x fp32 [K] -> xq int8 [K], xs fp32 [K/32]; gsum fp32 [K/group] = sum over the group of xq * xs. */
static void quantize_row(const float* x, int K, int group, int8_t* xq, float* xs, float* gsum) {
    int nb = K / QB, bpg = group / QB;
    for (int b = 0; b < nb; b++) {
        const float* xb = x + b * QB;
        float amax = 0.0f;
        for (int i = 0; i < QB; i++) amax = fmaxf(amax, fabsf(xb[i]));
        float inv = amax > 0.0f ? 127.0f / amax : 0.0f;
        int sum = 0;
        for (int i = 0; i < QB; i++) {
            int q = (int)nearbyintf(xb[i] * inv);
            xq[b * QB + i] = (int8_t)q;
            sum += q;
        }
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

#if MF_AVX2
/* Activation block b of ``tt`` tokens from t0: its 32 int8 values and its scale, broadcast. */
static inline __attribute__((always_inline)) void load_block(
    const int8_t* xq, const float* xs, int K, int b, int t0, int tt, __m256i* xv, __m256* xd) {
    int nb = K / QB;
    for (int i = 0; i < tt; i++) {
        size_t t = (size_t)(t0 + i);
        xv[i] = _mm256_loadu_si256((const __m256i*)(xq + t * K + b * QB));
        xd[i] = _mm256_broadcast_ss(xs + t * nb + b);
    }
}

static inline float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}
#endif

/* ``nr`` q4 weight rows from row n against ``tt`` tokens from token t0 (nr * tt independent accumulators, so
   the fused multiply-adds of successive blocks do not wait on each other): y[t, n .. n + nr). */
static inline __attribute__((always_inline)) void q4_tile(
    const uint8_t* qw, const float* s, const float* m, int K, int group, const int8_t* xq, const float* xs,
    const float* gsum, int n, int nr, int t0, int tt, float* y, int ldy) {
    int nb = K / QB, bpg = group / QB, ng = K / group;
    (void)nb;  /* the portable loops' */
    float out[TILE][TILE];
#if MF_AVX2
    const __m256i low = _mm256_set1_epi8(0x0F);
    const __m256i ones = _mm256_set1_epi16(1);
    /* per group: sum over its blocks of (integer block dot) * activation scale, then times the weight scale */
    __m256 acc[TILE][TILE];
    for (int r = 0; r < nr; r++)
        for (int i = 0; i < tt; i++) acc[r][i] = _mm256_setzero_ps();
    for (int g = 0; g < ng; g++) {
        __m256 accg[TILE][TILE];
        for (int r = 0; r < nr; r++)
            for (int i = 0; i < tt; i++) accg[r][i] = _mm256_setzero_ps();
        for (int b = g * bpg; b < (g + 1) * bpg; b++) {
            __m256i xv[TILE];
            __m256 xd[TILE];
            load_block(xq, xs, K, b, t0, tt, xv, xd);
            for (int r = 0; r < nr; r++) {
                const uint8_t* row = qw + (size_t)(n + r) * (K / 2);
                __m128i raw = _mm_loadu_si128((const __m128i*)(row + b * (QB / 2)));
                if ((b & 3) == 0)  /* the rows after this tile's: the stream the hardware prefetcher misses */
                    _mm_prefetch((const char*)(row + (size_t)PREFETCH_ROWS * (K / 2) + b * (QB / 2)), _MM_HINT_T0);
                __m256i q = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(raw, 4), raw), low);
                for (int i = 0; i < tt; i++) {
                    __m256i p = _mm256_madd_epi16(_mm256_maddubs_epi16(q, xv[i]), ones);
                    accg[r][i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), xd[i], accg[r][i]);
                }
            }
        }
        for (int r = 0; r < nr; r++) {
            __m256 sw = _mm256_broadcast_ss(s + (size_t)(n + r) * ng + g);
            for (int i = 0; i < tt; i++) acc[r][i] = _mm256_fmadd_ps(accg[r][i], sw, acc[r][i]);
        }
    }
    for (int r = 0; r < nr; r++)
        for (int i = 0; i < tt; i++) out[r][i] = hsum(acc[r][i]);
#else
    for (int r = 0; r < nr; r++) {
        const uint8_t* row = qw + (size_t)(n + r) * (K / 2);
        for (int i = 0; i < tt; i++) {
            size_t t = (size_t)(t0 + i);
            float a = 0.0f;
            for (int g = 0; g < ng; g++) {
                float ag = 0.0f;
                for (int b = g * bpg; b < (g + 1) * bpg; b++) {
                    const uint8_t* rb = row + b * (QB / 2);
                    const int8_t* xb = xq + t * K + b * QB;
                    int dot = 0;
                    for (int j = 0; j < QB / 2; j++) dot += (rb[j] & 0xF) * xb[j] + (rb[j] >> 4) * xb[QB / 2 + j];
                    ag += (float)dot * xs[t * nb + b];
                }
                a += ag * s[(size_t)(n + r) * ng + g];
            }
            out[r][i] = a;
        }
    }
#endif
    for (int r = 0; r < nr; r++) {
        const float* mr = m + (size_t)(n + r) * ng;
        for (int i = 0; i < tt; i++) {
            const float* gs = gsum + (size_t)(t0 + i) * ng;
            float z = 0.0f;
            for (int g = 0; g < ng; g++) z += mr[g] * gs[g];
            y[(size_t)(t0 + i) * ldy + n + r] = out[r][i] + z;
        }
    }
}

/* Rows [n0, n1) of a q4 matrix against all T quantized tokens: tiles of 4 rows x 1 token or 2 rows x 4 tokens. */
static void q4_rows(int n0, int n1, int T, int K, int group, const uint8_t* qw, const float* s, const float* m,
                    const int8_t* xq, const float* xs, const float* gsum, float* y, int ldy) {
    int n = n0;
    for (; n + 4 <= n1; n += 4) {
        int t0 = 0;
        for (; t0 + TILE <= T; t0 += TILE) {
            for (int r = 0; r < 4; r++) q4_tile(qw, s, m, K, group, xq, xs, gsum, n + r, 1, t0, TILE, y, ldy);
        }
        for (; t0 < T; t0++) q4_tile(qw, s, m, K, group, xq, xs, gsum, n, 4, t0, 1, y, ldy);
    }
    for (; n < n1; n++)
        for (int t0 = 0; t0 < T; t0++) q4_tile(qw, s, m, K, group, xq, xs, gsum, n, 1, t0, 1, y, ldy);
}

/* ``nr`` int8 weight rows from row n against ``tt`` tokens from token t0 (see q4_tile). */
static inline __attribute__((always_inline)) void q8_tile(
    const int8_t* w, const float* s, int K, const int8_t* xq, const float* xs, int n, int nr, int t0, int tt,
    float* y, int ldy) {
    int nb = K / QB;
#if MF_AVX2
    const __m256i ones = _mm256_set1_epi16(1);
    __m256 acc[TILE][TILE];
    for (int r = 0; r < nr; r++)
        for (int i = 0; i < tt; i++) acc[r][i] = _mm256_setzero_ps();
    for (int b = 0; b < nb; b++) {
        __m256i xv[TILE];
        __m256 xd[TILE];
        load_block(xq, xs, K, b, t0, tt, xv, xd);
        for (int r = 0; r < nr; r++) {
            const int8_t* row = w + (size_t)(n + r) * K;
            __m256i wv = _mm256_loadu_si256((const __m256i*)(row + b * QB));
            if ((b & 1) == 0) _mm_prefetch((const char*)(row + (size_t)PREFETCH_ROWS * K + b * QB), _MM_HINT_T0);
            __m256i wabs = _mm256_sign_epi8(wv, wv);  /* |w| x sign(w)*x: maddubs wants one unsigned operand */
            for (int i = 0; i < tt; i++) {
                __m256i p = _mm256_madd_epi16(_mm256_maddubs_epi16(wabs, _mm256_sign_epi8(xv[i], wv)), ones);
                acc[r][i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), xd[i], acc[r][i]);
            }
        }
    }
    for (int r = 0; r < nr; r++)
        for (int i = 0; i < tt; i++) y[(size_t)(t0 + i) * ldy + n + r] = s[n + r] * hsum(acc[r][i]);
#else
    for (int r = 0; r < nr; r++) {
        const int8_t* row = w + (size_t)(n + r) * K;
        for (int i = 0; i < tt; i++) {
            size_t t = (size_t)(t0 + i);
            float a = 0.0f;
            for (int b = 0; b < nb; b++) {
                int dot = 0;
                for (int j = 0; j < QB; j++) dot += row[b * QB + j] * xq[t * K + b * QB + j];
                a += (float)dot * xs[t * nb + b];
            }
            y[t * ldy + n + r] = s[n + r] * a;
        }
    }
#endif
}

static void q8_rows(int n0, int n1, int T, int K, const int8_t* w, const float* s, const int8_t* xq, const float* xs,
                    float* y, int ldy) {
    int n = n0;
    for (; n + 4 <= n1; n += 4) {
        int t0 = 0;
        for (; t0 + TILE <= T; t0 += TILE)
            for (int r = 0; r < 4; r++) q8_tile(w, s, K, xq, xs, n + r, 1, t0, TILE, y, ldy);
        for (; t0 < T; t0++) q8_tile(w, s, K, xq, xs, n, 4, t0, 1, y, ldy);
    }
    for (; n < n1; n++)
        for (int t0 = 0; t0 < T; t0++) q8_tile(w, s, K, xq, xs, n, 1, t0, 1, y, ldy);
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
        q4_rows(c * ROWS, n1, T, K, group, qw, s, m, xq, xs, gsum, y, N);
    }
    free(xq); free(xs);
    return 0;
}

/* y fp32 [T, N] = x fp32 [T, K] @ W.T for a q8 matrix. */
int mf_q8_linear(const float* x, int T, int K, int N, const int8_t* w, const float* s, float* y, int nthreads) {
    int8_t* xq = malloc((size_t)T * K);
    float* xs = malloc(sizeof(float) * (size_t)T * (K / QB));
    if (!xq || !xs) { free(xq); free(xs); return -1; }
    quantize_rows(x, T, K, 0, xq, xs, NULL, nthreads);
#pragma omp parallel for num_threads(nthreads) schedule(static)
    for (int c = 0; c < nchunks(N); c++) {
        int n1 = (c + 1) * ROWS < N ? (c + 1) * ROWS : N;
        q8_rows(c * ROWS, n1, T, K, w, s, xq, xs, y, N);
    }
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
            q4_rows(c * ROWS, n1, T, H, group, w13, s13, m13, xq, xs, gsum, h, 2 * I);
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
        q4_rows(c * ROWS, n1, T, I, group, w2, s2, m2, xq, xs, gsum, y, H);
        for (int t = 0; t < T; t++)
            for (int n = c * ROWS; n < n1; n++) {
                float v = weight[t] * y[(size_t)t * H + n];
                out[(size_t)t * H + n] = accumulate ? out[(size_t)t * H + n] + v : v;
            }
    }
    free(xq); free(f);
    return 0;
}
