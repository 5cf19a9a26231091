/* The one header of moeflow's CPU kernel sources (native.c, q4.c, q4z.c, q8.c, step.c, repack.c: one library,
   built by native.py); see native.c's comment. */
#ifndef MOEFLOW_CPU_NATIVE_H
#define MOEFLOW_CPU_NATIVE_H
#include <stdint.h>
#include <string.h>

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#include <math.h>
#include <string.h>
#define MF_AVX2 1
static inline __m256i bcast4(const int8_t* p) {  /* 4 int8 activations (one int32) to every lane */
    int32_t v;
    memcpy(&v, p, 4);
    return _mm256_set1_epi32(v);
}

/* expf of 8 floats, bit for bit glibc's expf (>= 2.27, its FMA variant: the same double-precision steps, table and
   fused multiply-adds, checked on every float): x*32/ln2 = k + r, 2^(k/32) from the table, a cubic in r. Lanes
   off its main path (|x| >= 88, inf, nan) take libm's expf itself. */
extern const uint64_t mf_exp2f_tab[32];
static inline __m128 mf_exp4d(__m256d xd) {
    const __m256d inv = _mm256_set1_pd(0x1.71547652b82fep+5), shift = _mm256_set1_pd(0x1.8p+52);
    __m256d kd = _mm256_fmadd_pd(inv, xd, shift);
    const __m256i ki = _mm256_castpd_si256(kd);
    kd = _mm256_sub_pd(kd, shift);
    const __m256d r = _mm256_fmsub_pd(inv, xd, kd);
    const __m256i t = _mm256_i64gather_epi64((const long long*)mf_exp2f_tab,
                                             _mm256_and_si256(ki, _mm256_set1_epi64x(31)), 8);
    const __m256d s = _mm256_castsi256_pd(_mm256_add_epi64(t, _mm256_slli_epi64(ki, 47)));
    const __m256d z = _mm256_fmadd_pd(_mm256_set1_pd(0x1.c6af84b912394p-20), r, _mm256_set1_pd(0x1.ebfce50fac4f3p-13));
    __m256d y = _mm256_fmadd_pd(_mm256_set1_pd(0x1.62e42ff0c52d6p-6), r, _mm256_set1_pd(1.0));
    y = _mm256_fmadd_pd(z, _mm256_mul_pd(r, r), y);
    return _mm256_cvtpd_ps(_mm256_mul_pd(y, s));
}
static inline __m256 mf_exp8(__m256 x) {
    const __m256i top = _mm256_and_si256(_mm256_srli_epi32(_mm256_castps_si256(x), 20), _mm256_set1_epi32(0x7ff));
    if (!_mm256_testz_si256(_mm256_cmpgt_epi32(top, _mm256_set1_epi32(0x42a)), _mm256_set1_epi32(-1))) {
        float v[8];
        _mm256_storeu_ps(v, x);
        for (int i = 0; i < 8; i++) v[i] = expf(v[i]);
        return _mm256_loadu_ps(v);
    }
    return _mm256_set_m128(mf_exp4d(_mm256_cvtps_pd(_mm256_extractf128_ps(x, 1))),
                           mf_exp4d(_mm256_cvtps_pd(_mm256_castps256_ps128(x))));
}
#else
#define MF_AVX2 0
#endif

/* AVX-512 with VNNI (Zen 4, Ice Lake and later; -march=native on such a CPU, unless the build asks for the AVX2
   path with -mno-avx512f: native.py's MOEFLOW_CPU_ISA=avx2). The integer dot products then run on
   vpdpbusd (q4.c: a row group's block on 256-bit registers, one weight stream as AVX2, or from 4 tokens two
   row groups per 512-bit register; q8.c: two row groups, 16 rows, per register): the same integer block sums (exact in int32) and the same
   fp32 operations per row as the AVX2 path, so the same bits (tests/test_cpu_isa.py). */
#if MF_AVX2 && defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512VNNI__)
#define MF_AVX512 1
/* Two 32-byte vectors (row groups A and B) as one 512-bit register: A's bytes in the low half. */
static inline __m512i mf_load2x256(const void* a, const void* b) {
    return _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256((const __m256i*)a)),
                              _mm256_loadu_si256((const __m256i*)b), 1);
}
static inline __m512 mf_load2x8ps(const float* a, const float* b) {
    return _mm512_castpd_ps(_mm512_insertf64x4(_mm512_castpd256_pd512(_mm256_castps_pd(_mm256_loadu_ps(a))),
                                               _mm256_castps_pd(_mm256_loadu_ps(b)), 1));
}
#else
#define MF_AVX512 0
#endif

#define QB 32       /* features per activation block */
#define MF_Q4_F32 0   /* q4 scales and mins fp32 (q4.c) */
#define MF_Q4_F16Z 1  /* q4 scales fp16, zero points uint8 in place of the mins (q4.c) */
#define MF_Q4_F16Z8 2 /* q4 scales fp16, every zero point 8, none stored (GGUF's Q4_0; group 32 only; q4.c) */

/* An IEEE half (bits) as a float, exactly (the portable form of F16C's conversion). */
static inline float mf_half_to_float(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1F, man = h & 0x3FF, bits;
    if (exp == 0x1F) {
        bits = sign | 0x7F800000 | (man << 13);  /* inf, nan */
    } else if (exp) {
        bits = sign | ((exp + 112) << 23) | (man << 13);
    } else if (man) {  /* subnormal half: a normal float */
        int e = -1;
        do { man <<= 1; e++; } while (!(man & 0x400));
        bits = sign | ((uint32_t)(112 - e) << 23) | ((man & 0x3FF) << 13);
    } else {
        bits = sign;
    }
    float f;
    memcpy(&f, &bits, 4);
    return f;
}
#define MF_QK_NONE 0  /* no QK-norm (step.c's attention) */
#define MF_QK_HEAD 1  /* RMSNorm of q and k per head, before the rotary (Qwen3) */
#define MF_QK_PROJ 2  /* RMSNorm of each token's whole q and whole k projection, before the rotary (OLMoE) */
#define Q4_GROUP 8  /* q4 weight rows interleaved together (q4.c's layout) */
#define MF_Q4_PREFETCH 3072  /* gguf.c's and gguf_k.c's weight prefetch distance: bytes ahead of the block being read */
/* q4.c's and q4z.c's weight prefetch (s17, issue 42): MF_Q4_PF_DIST bytes ahead of the block being read, into L2.
   One Mixtral-8x7B expert (AWQ group 128, 92 MB) at one token from DRAM, one Zen 4 core: 3072 bytes into L1
   (before s17) ~0.74 of a plain read's rate, 4-64 KB into L2 ~0.80-0.83, no prefetch ~0.7 (the whole file
   measured alike at one token; at four tokens no prefetch was 1.6x slower). -D overrides for tuning. */
#define MF_PRAGMA(x) _Pragma(#x)
#define MF_UNROLL(n) MF_PRAGMA(GCC unroll n)  /* a loop unrolled n times (gcc; clang reads it too) */
#ifndef MF_Q4_PF_DIST
#define MF_Q4_PF_DIST 8192
#endif
#ifndef MF_Q4_PF_HINT
#define MF_Q4_PF_HINT _MM_HINT_T1
#endif

#if MF_AVX512
/* One 32-feature block b of a q4 row group (128 bytes at wb: 8 rows, q4.c's layout) times tokens t0 .. t0 + tt - 1's
   int8 activations of the block (xq [T, K], tt <= 4): each row's exact int32 sum in lane r of dot[i], the AVX2
   path's integers. 256-bit vpdpbusd against each token's 4 activations broadcast: step c's low nibbles (p & 0x0F)
   against features 8c .. 8c + 3, its high ones left in place (p & 0xF0: 16x each nibble) against 8c + 4 .. 8c + 7,
   two independent sums, the second shifted down by 4 at the end (a multiple of 16: exact). 8 dpbusd, 8 and/andnot
   per block and no permutes, where two 512-bit registers took 4 permutes, 4 dpbusd and 6 shift/and per token and a
   fold of the halves (Zen 4 runs a 512-bit operation as two 256-bit halves): from the L2 cache -8 % at one token,
   -30 % at four (s17). */
static inline __attribute__((always_inline)) void mf_q4_block_dots256(const uint8_t* wb, const int8_t* xq, int K,
                                                                       int b, int t0, int tt, __m256i* dot) {
    const __m256i low = _mm256_set1_epi8(0x0F);
    __m256i dl[4], dh[4];
    for (int i = 0; i < tt; i++) dl[i] = dh[i] = _mm256_setzero_si256();
    for (int c = 0; c < 4; c++) {
        const __m256i p = _mm256_loadu_si256((const __m256i*)(wb + 32 * c));
        const __m256i lo = _mm256_and_si256(p, low), hi16 = _mm256_andnot_si256(low, p);
        for (int i = 0; i < tt; i++) {
            const int8_t* xb = xq + (size_t)(t0 + i) * K + b * QB + 8 * c;
            int32_t x0, x1;
            memcpy(&x0, xb, 4);
            memcpy(&x1, xb + 4, 4);
            dl[i] = _mm256_dpbusd_epi32(dl[i], lo, _mm256_set1_epi32(x0));
            dh[i] = _mm256_dpbusd_epi32(dh[i], hi16, _mm256_set1_epi32(x1));
        }
    }
    for (int i = 0; i < tt; i++) dot[i] = _mm256_add_epi32(dl[i], _mm256_srai_epi32(dh[i], 4));
}

/* One 32-feature block b of the AVX-512 two-row-group tile (q4.c's q4_pair_tile, q4z.c's q4z_pair_tile): the
   groups' 128 bytes each, at wa and wa + wb_off (prefetched MF_Q4_PF_DIST ahead), times tokens t0 .. t0 + tt - 1's
   int8 activations of the block (xq [T, K]): the low and high nibbles of even and odd 8-feature steps in four
   independent int32 sums dot[i][0..3], which the caller adds (exact). */
static inline __attribute__((always_inline)) void mf_q4_pair_block_dots(const uint8_t* wa, size_t wb_off,
                                                                         const int8_t* xq, int K, int b, int t0,
                                                                         int tt, __m512i (*dot)[4]) {
    const __m512i low = _mm512_set1_epi8(0x0F);
    _mm_prefetch((const char*)(wa + MF_Q4_PF_DIST), MF_Q4_PF_HINT);
    _mm_prefetch((const char*)(wa + MF_Q4_PF_DIST + 64), MF_Q4_PF_HINT);
    _mm_prefetch((const char*)(wa + wb_off + MF_Q4_PF_DIST), MF_Q4_PF_HINT);
    _mm_prefetch((const char*)(wa + wb_off + MF_Q4_PF_DIST + 64), MF_Q4_PF_HINT);
    for (int i = 0; i < tt; i++)
        for (int a = 0; a < 4; a++) dot[i][a] = _mm512_setzero_si512();
    for (int c = 0; c < 4; c++) {
        const __m512i p = mf_load2x256(wa + 32 * c, wa + wb_off + 32 * c);
        const __m512i lo = _mm512_and_si512(p, low);
        const __m512i hi = _mm512_and_si512(_mm512_srli_epi16(p, 4), low);
        const int a = 2 * (c & 1);
        for (int i = 0; i < tt; i++) {
            const int8_t* xb = xq + (size_t)(t0 + i) * K + b * QB + 8 * c;
            int32_t x0, x1;
            memcpy(&x0, xb, 4);
            memcpy(&x1, xb + 4, 4);
            dot[i][a] = _mm512_dpbusd_epi32(dot[i][a], lo, _mm512_set1_epi32(x0));
            dot[i][a + 1] = _mm512_dpbusd_epi32(dot[i][a + 1], hi, _mm512_set1_epi32(x1));
        }
    }
}
#endif
#define Q8_GROUP 8  /* q8 weight rows interleaved together (q8.c's layout) */
#define MF_ROWS 16  /* weight rows per parallel work item (native.c, step_region.c; a multiple of both groups) */

/* x fp32 [K] -> int8 activations xq [K], block scales xs [K/32], group sums gsum [K/group] (NULL: not wanted) and
   block sums of xq xsum [K/32] (NULL: not wanted) (native.c; the one quantizer of every linear's input). */
__attribute__((visibility("hidden"))) void mf_quantize_row(const float* x, int K, int group, int8_t* xq, float* xs,
                                                           float* gsum, int32_t* xsum);
/* out[i] = silu(g[i]) * u[i] for n features (native.c). */
void mf_silu_mul(const float* g, const float* u, int n, float* out);

/* Rows [n0, n1) of a q4 matrix [N, K] against T quantized tokens: y[t, n] for n in [n0, n1) (q4.c). */
__attribute__((visibility("hidden"))) void mf_q4_rows(
    int n0, int n1, int T, int K, int group, int fmt, const uint8_t* qw, const void* s, const void* m,
    const int8_t* xq, const float* xs, const float* gsum, const int32_t* xsum, float* y, int ldy);

/* Rows [n0, n1) of a q4 matrix [N, K] at group 32 with integer zero points (fmt MF_Q4_F16Z or MF_Q4_F16Z8; xsum
   int32 [T, K/32]: each block's sum of xq) against T quantized tokens (q4z.c). */
__attribute__((visibility("hidden"))) void mf_q4z_rows(
    int n0, int n1, int T, int K, int fmt, const uint8_t* qw, const void* s, const void* m, const int8_t* xq,
    const float* xs, const int32_t* xsum, float* y, int ldy);

/* Rows [n0, n1) of a q8 matrix [N, K] against T quantized tokens: y[t, n] for n in [n0, n1) (q8.c). */
__attribute__((visibility("hidden"))) void mf_q8_rows(
    int n0, int n1, int T, int K, const int8_t* w, const float* s, const int8_t* xq, const float* xs, float* y,
    int ldy);
/* Row n of a q8 matrix [N, K] against T quantized tokens: y[t * ldy] (q8.c). */
__attribute__((visibility("hidden"))) void mf_q8_row(
    int n, int N, int T, int K, const int8_t* w, const float* s, const int8_t* xq, const float* xs, float* y, int ldy);

/* Entry points called across sources (step.c calls native.c's linear kernels) and defined in repack.c: declared
   here so that every definition is checked against one declaration. */
int mf_q4_linear(const float* x, int T, int K, int N, int group, int fmt, const uint8_t* qw, const void* s,
                 const void* m, float* y, int nthreads);
int mf_q8_linear(const float* x, int T, int K, int N, const int8_t* w, const float* s, float* y, int nthreads);
int mf_q4_expert(const float* x, int T, int H, int I, int group, int fmt, const uint8_t* w13, const void* s13,
                 const void* m13, const uint8_t* w2, const void* s2, const void* m2, const float* weight,
                 float* out, int accumulate, int nthreads);
void mf_nibble_transpose(const uint32_t* in, int64_t rows, int64_t cols, const int32_t* row_order,
                         const int32_t* col_t, const int64_t* k_off, uint32_t* out);
void mf_nibble_transpose_grouped(const uint32_t* in, int64_t rows, int64_t cols, const int32_t* row_order,
                                 const int32_t* col_pos, int64_t c_stride, uint32_t* out);
void mf_permute_word_bits(const uint32_t* in, int64_t n, const uint32_t* lo, const uint32_t* hi, uint32_t* out);
void mf_q4_0_to_awq(const uint8_t* raw, int64_t n, int64_t k, const int32_t* row_order, uint32_t* qweight,
                    int64_t ld, uint16_t* scales, int64_t lds);
void mf_q4_0_to_q4z(const uint8_t* raw, int64_t n, int64_t k, int64_t row0, int64_t row1, uint8_t* packed,
                    uint16_t* scales);
void mf_quantize_rows_int8(const float* w, int64_t rows, int64_t cols, uint16_t* scales_bf16, int8_t* q);
int mf_quantize_rows_int8_grouped(const void* w, int kind, int64_t rows, int64_t cols, uint16_t* scales_bf16,
                                  int8_t* q, int nthreads);
#endif
