/* A Q4_K_M decode step's GGUF kernels alone, one thread (session 17, issue 42): the experts of the synthetic
   Mixtral's 8 layers (top-2 of 8, hidden 1024, intermediate 3584; Q4_K gate/up, Q6_K down in layers 0, 3, 6, 7 as
   llama-quantize's Q4_K_M writes them, Q4_K elsewhere) through gguf.c's mf_gguf_expert_team (the one-region
   step's call, here outside a region), the 32000 x 1024 Q6_K lm_head through mf_gguf_linear, and for calibration
   the same experts in the q4z form a Q4_0 file converts to (mf_q4z_rows: 8 rows interleaved, 18 bytes per 32
   weights). Distinct experts per token (400 MB in all: from memory); thread CPU time (the shared machine's
   preemption left out), the median of `reps` tokens; random blocks with small finite fp16 scales (the speed does
   not depend on the values). Mode `hot`: ns per block of one 32-row matrix kept in L2 (the compute alone).

     S=moeflow/kernels/cpu; gcc -O3 -march=native -ffp-contract=off -fopenmp benchmarks/cpu/gguf_kquant_step_bench.c \
         $S/native.c $S/q4.c $S/q4z.c $S/q8.c $S/step.c $S/step_region.c $S/repack.c $S/gguf.c $S/gguf_k.c \
         -o /tmp/kq_step -lm
     /tmp/kq_step step 30      # experts + head (K-quants), a plain read of the experts' bytes, the q4z experts
     /tmp/kq_step hot 1024     # compute per block, K = 1024 (4 blocks a row) */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <immintrin.h>

#include "../../moeflow/kernels/cpu/gguf.h"

void mf_q4z_rows(int n0, int n1, int T, int K, int fmt, const uint8_t* qw, const void* s, const void* m,
                 const int8_t* xq, const float* xs, const int32_t* xsum, float* y, int ldy);
void mf_quantize_row(const float* x, int K, int group, int8_t* xq, float* xs, float* gsum, int32_t* xsum);

enum { H = 1024, I = 3584, NL = 8, E = 8, V = 32000 };

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t);
    return t.tv_sec + 1e-9 * t.tv_nsec;
}
static int cmp(const void* a, const void* b) {
    const double d = *(const double*)a - *(const double*)b;
    return d < 0 ? -1 : d > 0;
}
static uint8_t* noise(size_t n) {  /* xorshift bytes, page aligned */
    static uint64_t z = 88172645463325252ull;
    uint8_t* w = aligned_alloc(4096, (n + 4095) & ~(size_t)4095);
    for (size_t i = 0; i < n; i += 8) {
        z ^= z << 13; z ^= z >> 7; z ^= z << 17;
        memcpy(w + i, &z, n - i < 8 ? n - i : 8);
    }
    return w;
}
static uint8_t* blocks(int type, size_t rows, int K) {  /* fp16 fields d (and dmin) set to small normal values */
    const size_t rb = (size_t)K / QKK * type_bytes(type);
    uint8_t* w = noise(rb * rows);
    for (size_t r = 0; r < rows; r++)
        for (int b = 0; b < K / QKK; b++) {
            uint8_t* p = w + r * rb + (size_t)b * type_bytes(type);
            const int off = type == GG_Q6_K ? 208 : 0;
            p[off + 1] = 0x10;
            if (type != GG_Q6_K) p[3] = 0x10;
        }
    return w;
}
static int pick(int r, int l, int j) {  /* the token's two distinct experts of layer l */
    const int e0 = (r * 3 + l * 5) % E, e1 = (r * 3 + l * 5 + 7) % E;
    return j == 0 ? e0 : (e1 == e0 ? (e1 + 1) % E : e1);
}
static double median(double* t, int n) { qsort(t, n, sizeof(double), cmp); return t[n / 2]; }

static void step(int reps) {
    static uint8_t *g[NL][E], *u[NL][E], *d[NL][E];
    int t2[NL];
    size_t eb = 0;
    for (int l = 0; l < NL; l++) {
        t2[l] = (l == 0 || l == 3 || l == 6 || l == 7) ? GG_Q6_K : GG_Q4_K;
        for (int e = 0; e < E; e++) {
            g[l][e] = blocks(GG_Q4_K, I, H);
            u[l][e] = blocks(GG_Q4_K, I, H);
            d[l][e] = blocks(t2[l], H, I);
        }
        eb += 2 * ((size_t)2 * I * (H / QKK) * type_bytes(GG_Q4_K) + (size_t)H * (I / QKK) * type_bytes(t2[l]));
    }
    uint8_t* head = blocks(GG_Q6_K, V, H);
    float *x = malloc(4 * H), *out = malloc(4 * H), *h = malloc(8 * I), *y = malloc(4 * H), *logits = malloc(4 * V);
    void* scratch = aligned_alloc(64, (mf_gguf_team_bytes(H, I) + 63) & ~(size_t)63);
    for (int i = 0; i < H; i++) x[i] = (float)((i * 7919) % 2001 - 1000) / 1000.0f;
    double *te = malloc(sizeof(double) * reps), *th = malloc(sizeof(double) * reps), cs = 0;
    for (int r = 0; r < reps; r++) {
        const double t0 = now();
        for (int l = 0; l < NL; l++)
            for (int j = 0; j < 2; j++) {
                const int e = pick(r, l, j);
                mf_gguf_expert_team(x, H, I, GG_Q4_K, g[l][e], u[l][e], (int64_t)H / QKK * type_bytes(GG_Q4_K), t2[l],
                                    d[l][e], (int64_t)I / QKK * type_bytes(t2[l]), 0.5f, out, j > 0, h, y, scratch);
            }
        const double t1 = now();
        mf_gguf_linear(x, 1, H, V, GG_Q6_K, head, (int64_t)H / QKK * type_bytes(GG_Q6_K), logits, 1);
        te[r] = t1 - t0;
        th[r] = now() - t1;
        cs += out[5] + logits[7];
    }
    const double me = median(te, reps), mh = median(th, reps), hb = (double)V * (H / QKK) * type_bytes(GG_Q6_K);
    printf("K-quant experts %.3f ms (%.1f MB, %.2f GB/s)  Q6_K head %.3f ms (%.2f GB/s)  checksum %.6g\n", me * 1e3,
           eb / 1e6, eb / me / 1e9, mh * 1e3, hb / mh / 1e9, cs);
    /* a plain read of the same expert bytes in the same order (4 streams of 256-bit loads): the roofline */
    for (int r = 0; r < reps; r++) {
        const double t0 = now();
        __m256i a0 = _mm256_setzero_si256(), a1 = a0;
        for (int l = 0; l < NL; l++)
            for (int j = 0; j < 2; j++) {
                const int e = pick(r, l, j);
                const uint8_t* m[3] = {g[l][e], u[l][e], d[l][e]};
                const size_t nb[3] = {(size_t)I * (H / QKK) * type_bytes(GG_Q4_K),
                                      (size_t)I * (H / QKK) * type_bytes(GG_Q4_K),
                                      (size_t)H * (I / QKK) * type_bytes(t2[l])};
                for (int k = 0; k < 3; k++)
                    for (size_t i = 0; i + 64 <= nb[k]; i += 64) {
                        a0 = _mm256_add_epi64(a0, _mm256_loadu_si256((const __m256i*)(m[k] + i)));
                        a1 = _mm256_add_epi64(a1, _mm256_loadu_si256((const __m256i*)(m[k] + i + 32)));
                    }
            }
        te[r] = now() - t0;
        cs += (double)_mm256_extract_epi64(_mm256_add_epi64(a0, a1), 0) * 1e-30;
    }
    const double mr = median(te, reps);
    printf("plain read      %.3f ms (%.1f MB, %.2f GB/s)  checksum %.3g\n", mr * 1e3, eb / 1e6, eb / mr / 1e9, cs);
    /* the same experts as q4z (Q4_0's converted form: codes [2I or H, K/2], fp16 scales [.., K/32], zero point 8) */
    static uint8_t *w13[NL][E], *s13[NL][E], *w2[NL][E], *s2[NL][E];
    for (int l = 0; l < NL; l++)
        for (int e = 0; e < E; e++) {
            w13[l][e] = noise((size_t)I * H);
            s13[l][e] = noise((size_t)2 * I * H / 32 * 2);
            w2[l][e] = noise((size_t)H * I / 2);
            s2[l][e] = noise((size_t)H * I / 32 * 2);
            for (size_t i = 1; i < (size_t)2 * I * H / 32 * 2; i += 2) s13[l][e][i] = 0x10;
            for (size_t i = 1; i < (size_t)H * I / 32 * 2; i += 2) s2[l][e][i] = 0x10;
        }
    int8_t *xq = malloc(H), *aq = malloc(I);
    float *xs = malloc(4 * I / 32), *as = malloc(4 * I / 32), *act = malloc(4 * I);
    int32_t *xsum = malloc(4 * I / 32), *asum = malloc(4 * I / 32);
    for (int r = 0; r < reps; r++) {
        const double t0 = now();
        for (int l = 0; l < NL; l++)
            for (int j = 0; j < 2; j++) {
                const int e = pick(r, l, j);
                mf_quantize_row(x, H, 32, xq, xs, NULL, xsum);
                mf_q4z_rows(0, 2 * I, 1, H, MF_Q4_F16Z8, w13[l][e], s13[l][e], NULL, xq, xs, xsum, h, 2 * I);
                mf_silu_mul(h, h + I, I, act);
                mf_quantize_row(act, I, 32, aq, as, NULL, asum);
                mf_q4z_rows(0, H, 1, I, MF_Q4_F16Z8, w2[l][e], s2[l][e], NULL, aq, as, asum, y, H);
            }
        te[r] = now() - t0;
    }
    const double qb = 2.0 * NL * 3 * I * H / 32 * 18, mq = median(te, reps);
    printf("q4z experts     %.3f ms (%.1f MB, %.2f GB/s)\n", mq * 1e3, qb / 1e6, qb / mq / 1e9);
}

static void hot(int type, int K) {
    enum { R = 32, IT = 200 };
    const int nb = K / QKK;
    uint8_t* w = blocks(type, R, K);
    acts a = {malloc(K), malloc(sizeof(float) * (K / QKK)), malloc(sizeof(int16_t) * (K / 16)), NULL, K, QKK, type};
    for (int i = 0; i < K; i++) a.q[i] = (int8_t)((i * 37) % 255 - 127);
    for (int i = 0; i < K / QKK; i++) a.s[i] = 0.01f;
    for (int gi = 0; gi < K / 16; gi++) {
        int s = 0;
        for (int i = 0; i < 16; i++) s += a.q[16 * gi + i];
        a.sum[gi] = (int16_t)s;
    }
    float y[R];
    double best = 1e9;
    for (int rep = 0; rep < 50; rep++) {
        const double t0 = now();
        for (int it = 0; it < IT; it++)
            mf_gguf_krows(type, w, (int64_t)nb * type_bytes(type), 0, R, nb, 1, &a, y, 1);
        const double t = now() - t0;
        best = t < best ? t : best;
    }
    const double ns = best / ((double)IT * R * nb) * 1e9;
    printf("hot type %d K %d: %.2f ns/block (%.1f GB/s) y0 %.6g\n", type, K, ns, type_bytes(type) / ns, y[0]);
}

int main(int argc, char** argv) {
    if (argc > 1 && !strcmp(argv[1], "hot")) {
        const int K = argc > 2 ? atoi(argv[2]) : 1024;
        hot(GG_Q4_K, K);
        hot(GG_Q5_K, K);
        hot(GG_Q6_K, K);
        return 0;
    }
    step(argc > 2 ? atoi(argv[2]) : 30);
    return 0;
}
