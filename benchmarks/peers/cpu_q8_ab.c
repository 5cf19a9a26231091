/* The int8 kernel of two source trees in one process (issue 21): a base tree's mf_q8_linear (linked in renamed
   base_q8_linear), this tree's mf_q8_linear and mf_q4_linear, and a streaming read of the same bytes, called in
   turn rep after rep so the shared machine's load hits all alike. Built and run by cpu_q8_ab.py; prints one JSON
   object per (N, T, threads): GB/s of weight bytes of the fastest rep of each. K = 4096. */
#include <immintrin.h>
#include <omp.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

int mf_q4_linear(const float* x, int T, int K, int N, int group, int fmt, const uint8_t* qw, const void* s,
                 const void* m, float* y, int nthreads);
int mf_q8_linear(const float* x, int T, int K, int N, const int8_t* w, const float* s, float* y, int nthreads);
int base_q8_linear(const float* x, int T, int K, int N, const int8_t* w, const float* s, float* y, int nthreads);

static double now(void) { struct timespec t; clock_gettime(CLOCK_MONOTONIC, &t); return t.tv_sec + t.tv_nsec * 1e-9; }

static int stream(const uint8_t* buf, size_t n, int threads) {
    int sink = 0;
#pragma omp parallel for num_threads(threads) schedule(static) reduction(+ : sink)
    for (size_t c = 0; c < n / 4096; c++) {
        __m256i a = _mm256_setzero_si256();
        for (size_t i = c * 4096; i < (c + 1) * 4096; i += 128) {
            const __m256i* p = (const __m256i*)(buf + i);
            a = _mm256_add_epi8(a, _mm256_add_epi8(_mm256_add_epi8(_mm256_load_si256(p), _mm256_load_si256(p + 1)),
                                                   _mm256_add_epi8(_mm256_load_si256(p + 2), _mm256_load_si256(p + 3))));
        }
        sink += _mm256_extract_epi32(a, 0);
    }
    return sink;
}

int main(int argc, char** argv) {
    if (argc < 5) { fprintf(stderr, "usage: N tokens,... threads,... reps\n"); return 2; }
    const int N = atoi(argv[1]), K = 4096, reps = atoi(argv[4]);
    const size_t n8 = (size_t)N * K;
    int8_t* w8 = aligned_alloc(64, n8);
    uint8_t* w4 = aligned_alloc(64, n8 / 2);
    uint8_t* sb = aligned_alloc(64, n8);
    float* s = malloc(sizeof(float) * N * (K / 128));
    float* m = malloc(sizeof(float) * N * (K / 128));
    float* x = malloc(sizeof(float) * 64 * K);
    float* y = malloc(sizeof(float) * 64 * (size_t)N);
    srand(0);
    for (size_t i = 0; i < n8; i++) w8[i] = (int8_t)(rand() % 255 - 127);
    for (size_t i = 0; i < n8 / 2; i++) w4[i] = (uint8_t)rand();
    memset(sb, 1, n8);
    for (int i = 0; i < N * (K / 128); i++) { s[i] = 1e-3f; m[i] = -1e-3f; }
    for (int i = 0; i < 64 * K; i++) x[i] = (float)rand() / RAND_MAX - 0.5f;
    const double by8 = (double)n8 + 4.0 * N, by4 = (double)n8 / 2 + 8.0 * N * (K / 128);
    int sink = 0;
    for (char* th_s = strtok(argv[3], ","); th_s; th_s = strtok(NULL, ",")) {
        const int th = atoi(th_s);
        char tokens[256];
        snprintf(tokens, sizeof tokens, "%s", argv[2]);
        char* save = NULL;
        for (char* t_s = strtok_r(tokens, ",", &save); t_s; t_s = strtok_r(NULL, ",", &save)) {
            const int T = atoi(t_s);
            double best[4] = {1e9, 1e9, 1e9, 1e9};
            for (int r = 0; r < reps; r++) {
                double t[5];
                t[0] = now(); base_q8_linear(x, T, K, N, w8, s, y, th);
                t[1] = now(); mf_q8_linear(x, T, K, N, w8, s, y, th);
                t[2] = now(); mf_q4_linear(x, T, K, N, 128, 0, w4, s, m, y, th);  /* fmt 0: fp32 scales */
                t[3] = now(); sink += stream(sb, n8, th);
                t[4] = now();
                for (int v = 0; v < 4; v++) if (t[v + 1] - t[v] < best[v]) best[v] = t[v + 1] - t[v];
            }
            printf("{\"n\": %d, \"k\": %d, \"tokens\": %d, \"threads\": %d, \"reps\": %d, \"base_q8_gbps\": %.2f, "
                   "\"q8_gbps\": %.2f, \"q4_gbps\": %.2f, \"stream_read_gbps\": %.2f}\n", N, K, T, th, reps,
                   by8 / best[0] / 1e9, by8 / best[1] / 1e9, by4 / best[2] / 1e9, n8 / best[3] / 1e9);
            fflush(stdout);
        }
    }
    return sink == 12345;
}
