/* Shared between moeflow's CPU kernel sources (cpu_native.c, cpu_q4.c, cpu_q8.c); see cpu_native.c's comment. */
#ifndef MOEFLOW_CPU_NATIVE_H
#define MOEFLOW_CPU_NATIVE_H
#include <stdint.h>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#include <string.h>
#define MF_AVX2 1
static inline __m256i bcast4(const int8_t* p) {  /* 4 int8 activations (one int32) to every lane */
    int32_t v;
    memcpy(&v, p, 4);
    return _mm256_set1_epi32(v);
}
#else
#define MF_AVX2 0
#endif

#define QB 32       /* features per activation block */
#define Q4_GROUP 8  /* q4 weight rows interleaved together (cpu_q4.c's layout) */
#define Q8_GROUP 8  /* q8 weight rows interleaved together (cpu_q8.c's layout) */

/* Rows [n0, n1) of a q4 matrix [N, K] against T quantized tokens: y[t, n] for n in [n0, n1) (cpu_q4.c). */
__attribute__((visibility("hidden"))) void mf_q4_rows(
    int n0, int n1, int T, int K, int group, const uint8_t* qw, const float* s, const float* m,
    const int8_t* xq, const float* xs, const float* gsum, float* y, int ldy);

/* Rows [n0, n1) of a q8 matrix [N, K] against T quantized tokens: y[t, n] for n in [n0, n1) (cpu_q8.c). */
__attribute__((visibility("hidden"))) void mf_q8_rows(
    int n0, int n1, int T, int K, const int8_t* w, const float* s, const int8_t* xq, const float* xs, float* y,
    int ldy);
/* Row n of a q8 matrix [N, K] against T quantized tokens: y[t * ldy] (cpu_q8.c). */
__attribute__((visibility("hidden"))) void mf_q8_row(
    int n, int N, int T, int K, const int8_t* w, const float* s, const int8_t* xq, const float* xs, float* y, int ldy);
#endif
