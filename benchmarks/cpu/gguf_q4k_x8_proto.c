/* What an interleaved Q4_K form would buy (issue 42, session 18): a PROTOTYPE measured here, not moeflow's
   library. Q4_K rows repacked 8 at a time so that the int32 lanes of a register are 8 rows (llama.cpp's
   q4_K_8x8 idea, this layout: per 8 rows and 256 inputs d[8] and dmin[8] fp16, the 6-bit scales and mins
   unpacked to bytes [sub-block][row], the codes [chunk][4-byte quad][row] as stored, 1184 bytes against 8 x 144):
   one vpdpbusd per 4 codes of 8 rows (the token's 4 bytes broadcast), one vpmulld by a scale per sub-block and 8
   rows, the fp32 work once per block and 8 rows, no horizontal sum. Checked against gguf_k.c's row kernel
   (different fp32 order: ~1e-7 relative), then timed beside it hot (32 rows in L2) and cold (40 matrices of
   3584 rows, from memory), one thread, thread CPU time. Results: benchmarks/results/peers/s18/kquant_README.md.

     S=moeflow/kernels/cpu; gcc -O3 -march=native -ffp-contract=off -fopenmp -I$S benchmarks/cpu/gguf_q4k_x8_proto.c \
         $S/native.c $S/q4.c $S/q4z.c $S/q8.c $S/step.c $S/step_region.c $S/step_gptoss.c $S/step_head.c $S/repack.c \
         $S/gguf.c $S/gguf_k.c $S/mxfp4.c $S/mxfp4_epilogue.c -o /tmp/x8 -lm
     /tmp/x8 1024; /tmp/x8 3584      (needs AVX-512 VNNI) */
#include <immintrin.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include "gguf.h"

static double now(void) { struct timespec t; clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t); return t.tv_sec + 1e-9 * t.tv_nsec; }
static int cmpd(const void* a, const void* b) { double d = *(const double*)a - *(const double*)b; return d < 0 ? -1 : d > 0; }
/* x8 block (per 8 rows, per 256 inputs): d[8] fp16, dmin[8] fp16, sc[8 sub][8 rows] u8, mn[8 sub][8 rows] u8,
   codes[4 chunks][8 quads][8 rows][4 bytes] */
enum { XB = 32 + 64 + 64 + 1024 };
static void repack(const uint8_t* w, int rows, int K, uint8_t* out) {
    const int nb = K / 256, rb = nb * 144;
    for (int g = 0; g < rows / 8; g++)
        for (int b = 0; b < nb; b++) {
            uint8_t* o = out + ((size_t)g * nb + b) * XB;
            for (int r = 0; r < 8; r++) {
                const uint8_t* s = w + (size_t)(8 * g + r) * rb + (size_t)b * 144;
                memcpy(o + 2 * r, s, 2);
                memcpy(o + 16 + 2 * r, s + 2, 2);
                uint64_t sc8, mn8;
                k4_scales(s + 4, &sc8, &mn8);
                for (int i = 0; i < 8; i++) { o[32 + 8 * i + r] = (sc8 >> (8 * i)) & 0xFF; o[96 + 8 * i + r] = (mn8 >> (8 * i)) & 0xFF; }
                for (int c = 0; c < 4; c++)
                    for (int q = 0; q < 8; q++) memcpy(o + 160 + ((c * 8 + q) * 8 + r) * 4, s + 16 + 32 * c + 4 * q, 4);
            }
        }
}
/* rows of groups [g0, g1) against one token's Q8_K acts */
static void x8rows(const uint8_t* xw, int g0, int g1, int nb, const int8_t* xq, const int16_t* bsum, const float* xs, float* y) {
    const __m256i m4 = _mm256_set1_epi8(0x0F), m4h = _mm256_set1_epi8((char)0xF0);
    for (int g = g0; g < g1; g++) {
        __m256 acc = _mm256_setzero_ps();
        for (int b = 0; b < nb; b++) {
            const uint8_t* o = xw + ((size_t)g * nb + b) * XB;
            for (int k = 0; k < XB; k += 64) _mm_prefetch((const char*)(o + 4096 + k), _MM_HINT_T0);
            const int8_t* x = xq + 256 * b;
            const int16_t* bs = bsum + 16 * b;
            __m256i is = _mm256_setzero_si256(), im = _mm256_setzero_si256();
            for (int c = 0; c < 4; c++) {
                __m256i alo = _mm256_setzero_si256(), ahi = _mm256_setzero_si256();
                for (int q = 0; q < 8; q++) {
                    const __m256i v = _mm256_loadu_si256((const __m256i*)(o + 160 + (c * 8 + q) * 32));
                    int32_t xl, xh;
                    memcpy(&xl, x + 64 * c + 4 * q, 4);
                    memcpy(&xh, x + 64 * c + 32 + 4 * q, 4);
                    alo = _mm256_dpbusd_epi32(alo, _mm256_and_si256(v, m4), _mm256_set1_epi32(xl));
                    ahi = _mm256_dpbusd_epi32(ahi, _mm256_and_si256(v, m4h), _mm256_set1_epi32(xh));
                }
                const __m256i s0 = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)(o + 32 + 16 * c)));
                const __m256i s1 = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)(o + 40 + 16 * c)));
                is = _mm256_add_epi32(is, _mm256_mullo_epi32(alo, s0));
                is = _mm256_add_epi32(is, _mm256_mullo_epi32(_mm256_srai_epi32(ahi, 4), s1));
            }
            for (int i = 0; i < 8; i++) {
                const __m256i m = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)(o + 96 + 8 * i)));
                im = _mm256_add_epi32(im, _mm256_mullo_epi32(m, _mm256_set1_epi32(bs[2 * i] + bs[2 * i + 1])));
            }
            const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)o));
            const __m256 dm = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(o + 16)));
            const __m256 s = _mm256_set1_ps(xs[b]);
            acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(is), _mm256_mul_ps(d, s), acc);
            acc = _mm256_fnmadd_ps(_mm256_cvtepi32_ps(im), _mm256_mul_ps(dm, s), acc);
        }
        _mm256_storeu_ps(y + 8 * g, acc);
    }
}
static uint8_t* noise(size_t n) { static uint64_t z = 88172645463325252ull; uint8_t* w = aligned_alloc(4096, (n + 4095) & ~(size_t)4095);
    for (size_t i = 0; i < n; i++) { z ^= z << 13; z ^= z >> 7; z ^= z << 17; w[i] = (uint8_t)z; } return w; }
static uint8_t* blocks(size_t rows, int K) { uint8_t* w = noise(rows * K / 256 * 144);
    for (size_t i = 0; i < rows * K / 256; i++) { w[i * 144 + 1] = 0x10; w[i * 144 + 3] = 0x10; } return w; }

int main(int argc, char** argv) {
    const int K = argc > 1 ? atoi(argv[1]) : 1024, nb = K / 256;
    /* acts */
    int8_t* xq = malloc(K); int16_t* bsum = malloc(2 * K / 16); float* xs = malloc(4 * nb);
    for (int i = 0; i < K; i++) xq[i] = (int8_t)((i * 37) % 255 - 127);
    for (int g = 0; g < K / 16; g++) { int s = 0; for (int i = 0; i < 16; i++) s += xq[16 * g + i]; bsum[g] = s; }
    for (int b = 0; b < nb; b++) xs[b] = 0.01f;
    acts a = {xq, xs, bsum, NULL, K, 256, GG_Q4_K};
    /* check against the row kernel */
    enum { R = 32 };
    uint8_t* w = blocks(R, K); uint8_t* xw = aligned_alloc(64, (size_t)R / 8 * nb * XB);
    repack(w, R, K, xw);
    float y0[R], y1[R];
    mf_gguf_krows(GG_Q4_K, w, nb * 144, 0, R, nb, 1, &a, y0, 1);
    x8rows(xw, 0, R / 8, nb, xq, bsum, xs, y1);
    double err = 0, mx = 0;
    for (int r = 0; r < R; r++) { double e = y0[r] - y1[r]; err = e * e > err ? e * e : err; mx = y0[r] * y0[r] > mx ? y0[r] * y0[r] : mx; }
    printf("K %d: max |row - x8| / max |row| = %.3g\n", K, __builtin_sqrt(err / mx));
    /* hot */
    double br = 1e9, bx = 1e9;
    for (int rep = 0; rep < 50; rep++) {
        double t0 = now(); for (int it = 0; it < 200; it++) mf_gguf_krows(GG_Q4_K, w, nb * 144, 0, R, nb, 1, &a, y0, 1);
        double t1 = now(); for (int it = 0; it < 200; it++) x8rows(xw, 0, R / 8, nb, xq, bsum, xs, y1);
        double t2 = now(); br = t1 - t0 < br ? t1 - t0 : br; bx = t2 - t1 < bx ? t2 - t1 : bx;
    }
    printf("hot ns per row-block: row kernel %.2f, x8 %.2f\n", br / (200.0 * R * nb) * 1e9, bx / (200.0 * R * nb) * 1e9);
    /* cold: 48 matrices of 3584 rows (~ 380 MB), each read once per pass */
    enum { M = 40, N = 3584 };
    uint8_t *wr[M], *wx[M];
    for (int m = 0; m < M; m++) { wr[m] = blocks(N, K); wx[m] = aligned_alloc(4096, (size_t)N / 8 * nb * XB); repack(wr[m], N, K, wx[m]); }
    float* y = malloc(4 * N);
    double tr[9], tx[9];
    for (int rep = 0; rep < 9; rep++) {
        double t0 = now(); for (int m = 0; m < M; m++) mf_gguf_krows(GG_Q4_K, wr[m], nb * 144, 0, N, nb, 1, &a, y, 1);
        double t1 = now(); for (int m = 0; m < M; m++) x8rows(wx[m], 0, N / 8, nb, xq, bsum, xs, y);
        double t2 = now(); tr[rep] = t1 - t0; tx[rep] = t2 - t1;
    }
    qsort(tr, 9, 8, cmpd); qsort(tx, 9, 8, cmpd);
    const double by = (double)M * N * nb * 144, byx = (double)M * N / 8 * nb * XB;
    printf("cold (%.0f MB): row kernel %.2f ms %.2f GB/s; x8 %.2f ms %.2f GB/s (of its %.0f MB)\n", by / 1e6, tr[4] * 1e3, by / tr[4] / 1e9, tx[4] * 1e3, byx / tx[4] / 1e9, byx / 1e6);
    return 0;
}
