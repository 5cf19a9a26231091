/* This machine's roofline for moeflow's CPU kernels (issue 21): streaming read bandwidth per core and in all,
   and the peak rate of the AVX2 integer multiply the q4 kernel is made of (vpmaddubsw: 32 byte products summed
   in pairs), alone and with the int16 add and the activation broadcast the kernel pairs with each one.
   Built and run by cpu_roofline.py; prints one JSON object. */
#include <immintrin.h>
#include <omp.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

static double now(void) { struct timespec t; clock_gettime(CLOCK_MONOTONIC, &t); return t.tv_sec + t.tv_nsec * 1e-9; }

static double stream_gbps(const uint8_t* buf, size_t n, int threads) {
    double best = 1e9;
    for (int rep = 0; rep < 5; rep++) {
        double t0 = now();
        int sink = 0;
#pragma omp parallel num_threads(threads) reduction(+ : sink)
        {
            __m256i a0 = _mm256_setzero_si256(), a1 = a0, a2 = a0, a3 = a0;
#pragma omp for schedule(static)
            for (size_t i = 0; i < n; i += 128) {
                const __m256i* p = (const __m256i*)(buf + i);
                a0 = _mm256_add_epi8(a0, _mm256_load_si256(p));
                a1 = _mm256_add_epi8(a1, _mm256_load_si256(p + 1));
                a2 = _mm256_add_epi8(a2, _mm256_load_si256(p + 2));
                a3 = _mm256_add_epi8(a3, _mm256_load_si256(p + 3));
            }
            sink += _mm256_extract_epi32(_mm256_add_epi8(_mm256_add_epi8(a0, a1), _mm256_add_epi8(a2, a3)), 0);
        }
        double dt = now() - t0;
        if (dt < best) best = dt;
        if (sink == 12345) puts("");
    }
    return n / best / 1e9;
}

#define R8(op) op(0) op(1) op(2) op(3) op(4) op(5) op(6) op(7)
#define MUB(i) "vpmaddubsw %%ymm12, %%ymm13, %%ymm" #i "\n\t"
#define MUB_ADD(i) "vpmaddubsw %%ymm12, %%ymm13, %%ymm14\n\tvpaddw %%ymm14, %%ymm" #i ", %%ymm" #i "\n\t"
#define BC_MUB_ADD(i) "vpbroadcastd " #i "*4(%1), %%ymm14\n\tvpmaddubsw %%ymm14, %%ymm13, %%ymm15\n\t" \
                      "vpaddw %%ymm15, %%ymm" #i ", %%ymm" #i "\n\t"
#define LOOP(BODY) __asm__ volatile("1:\n\t" R8(BODY) "dec %0\n\tjnz 1b" : "+r"(c) : "r"(mem) \
    : "xmm0", "xmm1", "xmm2", "xmm3", "xmm4", "xmm5", "xmm6", "xmm7", "xmm14", "xmm15")

int main(void) {
    size_t n = (size_t)1 << 30;
    uint8_t* buf = aligned_alloc(64, n);
    memset(buf, 1, n);
    double bw1 = stream_gbps(buf, n, 1), bw2 = stream_gbps(buf, n, 2);
    long iters = 100000000, c = iters;
    int mem[16] = {0};
    double t0 = now();
    __asm__ volatile("1:\n\t" "add $1,%%rax\n\tadd $1,%%rax\n\tadd $1,%%rax\n\tadd $1,%%rax\n\t"
                     "add $1,%%rax\n\tadd $1,%%rax\n\tadd $1,%%rax\n\tadd $1,%%rax\n\tdec %0\n\tjnz 1b"
                     : "+r"(c) : : "rax");
    double ghz = iters * 8 / (now() - t0) / 1e9;  /* a chain of dependent adds: one per cycle */
    double rate[3];
    c = iters; t0 = now(); LOOP(MUB); rate[0] = iters * 8 / (now() - t0) / 1e9;
    c = iters; t0 = now(); LOOP(MUB_ADD); rate[1] = iters * 8 / (now() - t0) / 1e9;
    c = iters; t0 = now(); LOOP(BC_MUB_ADD); rate[2] = iters * 8 / (now() - t0) / 1e9;
    printf("{\"stream_read_gbps_1_thread\": %.2f, \"stream_read_gbps_2_threads\": %.2f, \"clock_ghz\": %.2f, "
           "\"maddubs_g_per_s\": %.2f, \"maddubs_paddw_g_per_s\": %.2f, \"bcast_maddubs_paddw_g_per_s\": %.2f}\n",
           bw1, bw2, ghz, rate[0], rate[1], rate[2]);
    free(buf);
    return 0;
}
