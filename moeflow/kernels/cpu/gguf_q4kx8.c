/* Q4_K rows interleaved 8 at a time (issue 42, session 19; gguf.h's GG_Q4_KX8): the form a GGUF model's Q4_K
   expert matrices are repacked into at load on the CPU (moeflow/kernels/cpu/gguf_repack.py), the idea of
   llama.cpp's q4_K_8x8 "CPU_REPACK" buffer in session 18's layout (benchmarks/cpu/gguf_q4k_x8_proto.c).

   Layout: a matrix of N rows (N a multiple of 8) and nb = K / 256 blocks per row is [N / 8][nb][XB] bytes, XB =
   1184 (against 8 x 144 stored): per 8 rows r < 8 and block b,
     [0, 16)      d[r]     fp16 (the stored field)
     [16, 32)     dmin[r]  fp16
     [32, 96)     sc[i][r] the 6-bit scale of sub-block i (i < 8) of row r, one byte
     [96, 160)    mn[i][r] its 6-bit min
     [160, 1184)  qs[c][q][r][4]: chunk c < 4, quad q < 8: row r's stored bytes 32 c + 4 q .. + 3 (low nibbles:
                  codes 64 c + 4 q + j of sub-block 2 c, high nibbles: codes 64 c + 32 + 4 q + j of sub-block 2c + 1)
   A "row stride" for this form is XB / 8 = 148 bytes per block (rows 8 g .. 8 g + 7 start at 8 g x stride).

   Numerics (gguf.c's Q4_K, the same as gguf_k.c's row kernel since session 19): per row, token and block, two exact
   int32 sums, isum = sum_i sc_i sum_(codes of sub-block i) q xq and imin = sum_i mn_i (sum of sub-block i's xq),
   then across blocks two fp32 accumulators, A = fma(isum, d xs, A), B = fma(imin, dmin xs, B), and y = A - B.
   The integers are exact whatever their order, so the row kernel, this kernel and every ISA give the same bits.

   How (one token, 8 rows a block): AVX-512 VNNI: per quad one vpdpbusd of the 8 rows' 4 low-nibble codes and one of
   the high nibbles left in place (16 q: at most 32 * 240 * 127 per sub-block, exact in int32, shifted back after)
   against the token's 4 bytes broadcast, then per sub-block one vpmulld by the 8 rows' scales; AVX2: maddubs + pmaddwd
   per quad (codes at most 15: no saturation); portable C: the same sums in loops. */

#include <math.h>
#include <stdint.h>
#include <string.h>

#include "gguf.h"

#define XB 1184

/* ---- repack ----------------------------------------------------------------------------------------------------- */

/* Rows [8 g0, 8 g1) of a stored Q4_K matrix (rows `stride` bytes apart, nb blocks) into the interleaved form
   `out` (the whole matrix's; groups g0 .. g1 - 1 written). */
static void repack_groups(const uint8_t* w, int64_t stride, int nb, int g0, int g1, uint8_t* out) {
    for (int g = g0; g < g1; g++)
        for (int b = 0; b < nb; b++) {
            uint8_t* o = out + ((size_t)g * nb + b) * XB;
            for (int r = 0; r < 8; r++) {
                const uint8_t* s = w + (size_t)(8 * g + r) * stride + (size_t)b * 144;
                memcpy(o + 2 * r, s, 2);
                memcpy(o + 16 + 2 * r, s + 2, 2);
                uint64_t sc8, mn8;
                k4_scales(s + 4, &sc8, &mn8);
                for (int i = 0; i < 8; i++) {
                    o[32 + 8 * i + r] = (uint8_t)(sc8 >> (8 * i));
                    o[96 + 8 * i + r] = (uint8_t)(mn8 >> (8 * i));
                }
#if !MF_AVX2
                for (int c = 0; c < 4; c++)
                    for (int q = 0; q < 8; q++) memcpy(o + 160 + ((c * 8 + q) * 8 + r) * 4, s + 16 + 32 * c + 4 * q, 4);
#endif
            }
#if MF_AVX2
            /* the codes: per chunk an 8 x 8 transpose of dwords (row r's quad q -> vector q's dword r) */
            const uint8_t* s0 = w + (size_t)(8 * g) * stride + (size_t)b * 144 + 16;
            for (int c = 0; c < 4; c++) {
                __m256i v[8], t[8], u[8];
                for (int r = 0; r < 8; r++) v[r] = _mm256_loadu_si256((const __m256i*)(s0 + (size_t)r * stride + 32 * c));
                for (int k = 0; k < 4; k++) {  /* t[2k] (rows 2k, 2k + 1): quads 0, 1 | 4, 5; t[2k + 1]: 2, 3 | 6, 7 */
                    t[2 * k] = _mm256_unpacklo_epi32(v[2 * k], v[2 * k + 1]);
                    t[2 * k + 1] = _mm256_unpackhi_epi32(v[2 * k], v[2 * k + 1]);
                }
                for (int k = 0; k < 2; k++) {  /* u[4k + j] (rows 4k .. 4k + 3): quad j | j + 4 */
                    u[4 * k] = _mm256_unpacklo_epi64(t[4 * k], t[4 * k + 2]);
                    u[4 * k + 1] = _mm256_unpackhi_epi64(t[4 * k], t[4 * k + 2]);
                    u[4 * k + 2] = _mm256_unpacklo_epi64(t[4 * k + 1], t[4 * k + 3]);
                    u[4 * k + 3] = _mm256_unpackhi_epi64(t[4 * k + 1], t[4 * k + 3]);
                }
                uint8_t* d = o + 160 + c * 8 * 32;
                for (int j = 0; j < 4; j++) {
                    _mm256_storeu_si256((__m256i*)(d + 32 * j), _mm256_permute2x128_si256(u[j], u[4 + j], 0x20));
                    _mm256_storeu_si256((__m256i*)(d + 32 * (j + 4)), _mm256_permute2x128_si256(u[j], u[4 + j], 0x31));
                }
            }
#endif
        }
}

/* A Q4_K matrix w [N, nb * 144 bytes] (rows `stride` bytes apart) -> out [N / 8][nb][1184] (nthreads OpenMP threads;
   1: the calling thread alone). Returns 0, or -2 when N is not a multiple of 8 or nb < 1. */
int mf_q4k_x8_repack(const uint8_t* w, int64_t stride, int N, int nb, uint8_t* out, int nthreads) {
    if (N % 8 || N < 8 || nb < 1) return -2;
    const int ng = N / 8;
    if (nthreads <= 1) {
        repack_groups(w, stride, nb, 0, ng, out);
        return 0;
    }
#pragma omp parallel for num_threads(nthreads) schedule(static)
    for (int g = 0; g < ng; g++) repack_groups(w, stride, nb, g, g + 1, out);
    return 0;
}

/* The inverse: the interleaved form x [N / 8][nb][1184] -> stored Q4_K rows w [N, nb * 144] (contiguous): the same
   bytes except that the twelve packed scale bytes are re-encoded from the unpacked 6-bit scales (the encoding is
   one-to-one). For tests and the fp32 model. Returns 0 or -2 as mf_q4k_x8_repack. */
int mf_q4k_x8_unpack(const uint8_t* x, int N, int nb, uint8_t* w) {
    if (N % 8 || N < 8 || nb < 1) return -2;
    for (int g = 0; g < N / 8; g++)
        for (int b = 0; b < nb; b++) {
            const uint8_t* o = x + ((size_t)g * nb + b) * XB;
            for (int r = 0; r < 8; r++) {
                uint8_t* s = w + (size_t)(8 * g + r) * nb * 144 + (size_t)b * 144;
                memcpy(s, o + 2 * r, 2);
                memcpy(s + 2, o + 16 + 2 * r, 2);
                uint8_t sc[8], mn[8];
                for (int i = 0; i < 8; i++) { sc[i] = o[32 + 8 * i + r]; mn[i] = o[96 + 8 * i + r]; }
                for (int j = 0; j < 4; j++) {  /* k4_scales' inverse */
                    s[4 + j] = (uint8_t)((sc[j] & 63) | ((sc[j + 4] >> 4) << 6));
                    s[8 + j] = (uint8_t)((mn[j] & 63) | ((mn[j + 4] >> 4) << 6));
                    s[12 + j] = (uint8_t)((sc[j + 4] & 15) | ((mn[j + 4] & 15) << 4));
                }
                for (int c = 0; c < 4; c++)
                    for (int q = 0; q < 8; q++) memcpy(s + 16 + 32 * c + 4 * q, o + 160 + ((c * 8 + q) * 8 + r) * 4, 4);
            }
        }
    return 0;
}

/* ---- the kernel ------------------------------------------------------------------------------------------------- */

/* One token (xq: its 256 codes of block b, bs: their 16 sums of 16, xs: the block's scale) against block o of 8
   rows: A[r] = fma(isum_r, d_r xs, A[r]), B[r] = fma(imin_r, dmin_r xs, B[r]). */
#if MF_AVX2
INLINE void x8_block(const uint8_t* o, const int8_t* x, const int16_t* bs, float xs, __m256* A, __m256* B) {
    const __m256i m4 = _mm256_set1_epi8(0x0F);
    __m256i is = _mm256_setzero_si256();
    for (int c = 0; c < 4; c++) {
        __m256i alo = _mm256_setzero_si256(), ahi = _mm256_setzero_si256();
        for (int q = 0; q < 8; q++) {
            const __m256i v = _mm256_loadu_si256((const __m256i*)(o + 160 + (c * 8 + q) * 32));
            int32_t xl, xh;
            memcpy(&xl, x + 64 * c + 4 * q, 4);
            memcpy(&xh, x + 64 * c + 32 + 4 * q, 4);
#if MF_AVX512
            alo = _mm256_dpbusd_epi32(alo, _mm256_and_si256(v, m4), _mm256_set1_epi32(xl));
            ahi = _mm256_dpbusd_epi32(ahi, _mm256_andnot_si256(m4, v), _mm256_set1_epi32(xh));  /* 16 q */
#else
            const __m256i one = _mm256_set1_epi16(1);
            alo = _mm256_add_epi32(alo, _mm256_madd_epi16(
                _mm256_maddubs_epi16(_mm256_and_si256(v, m4), _mm256_set1_epi32(xl)), one));
            ahi = _mm256_add_epi32(ahi, _mm256_madd_epi16(
                _mm256_maddubs_epi16(_mm256_and_si256(_mm256_srli_epi16(v, 4), m4), _mm256_set1_epi32(xh)), one));
#endif
        }
#if MF_AVX512
        ahi = _mm256_srai_epi32(ahi, 4);  /* exact: a multiple of 16 */
#endif
        const __m256i s0 = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)(o + 32 + 16 * c)));
        const __m256i s1 = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)(o + 40 + 16 * c)));
        is = _mm256_add_epi32(is, _mm256_add_epi32(_mm256_mullo_epi32(alo, s0), _mm256_mullo_epi32(ahi, s1)));
    }
    __m256i im = _mm256_setzero_si256();
    for (int i = 0; i < 8; i++) {
        const __m256i m = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)(o + 96 + 8 * i)));
        im = _mm256_add_epi32(im, _mm256_mullo_epi32(m, _mm256_set1_epi32(bs[2 * i] + bs[2 * i + 1])));
    }
    const __m256 s = _mm256_set1_ps(xs);
    const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)o));
    const __m256 dm = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(o + 16)));
    *A = _mm256_fmadd_ps(_mm256_cvtepi32_ps(is), _mm256_mul_ps(d, s), *A);
    *B = _mm256_fmadd_ps(_mm256_cvtepi32_ps(im), _mm256_mul_ps(dm, s), *B);
}
#else
INLINE void x8_block(const uint8_t* o, const int8_t* x, const int16_t* bs, float xs, float* A, float* B) {
    for (int r = 0; r < 8; r++) {
        int32_t is = 0, im = 0;
        for (int c = 0; c < 4; c++) {
            int32_t lo = 0, hi = 0;
            for (int q = 0; q < 8; q++)
                for (int j = 0; j < 4; j++) {
                    const uint8_t v = o[160 + ((c * 8 + q) * 8 + r) * 4 + j];
                    lo += (v & 15) * x[64 * c + 4 * q + j];
                    hi += (v >> 4) * x[64 * c + 32 + 4 * q + j];
                }
            is += lo * o[32 + 16 * c + r] + hi * o[40 + 16 * c + r];
        }
        for (int i = 0; i < 8; i++) im += o[96 + 8 * i + r] * (bs[2 * i] + bs[2 * i + 1]);
        A[r] = fmaf((float)is, h2f(o + 2 * r) * xs, A[r]);
        B[r] = fmaf((float)im, h2f(o + 16 + 2 * r) * xs, B[r]);
    }
}
#endif

/* Rows [n0, n1) (multiples of 8) of the interleaved matrix w (`stride`: 148 bytes per block, gguf.h) against the T
   quantized tokens of `a` (Q8_K activations): y[t * ldy + n]. */
void mf_gguf_x8rows(const uint8_t* w, int64_t stride, int n0, int n1, int nb, int T, const acts* a, float* y,
                    int ldy) {
    const int K = a->K;
    for (int g = n0 / 8; g < n1 / 8; g++) {
        const uint8_t* wg = w + (size_t)g * 8 * stride;
        for (int t = 0; t < T; t++) {
            const int8_t* xq = a->q + (size_t)t * K;
            const int16_t* bs = a->sum + (size_t)t * (K / 16);
            const float* xs = a->s + (size_t)t * (K / QKK);
#if MF_AVX2
            __m256 A = _mm256_setzero_ps(), B = _mm256_setzero_ps();
            for (int b = 0; b < nb; b++) {
                const uint8_t* o = wg + (size_t)b * XB;
                if (t == 0)
                    for (int k = 0; k < XB; k += 64) _mm_prefetch((const char*)(o + MF_Q4_PREFETCH + k), _MM_HINT_T0);
                x8_block(o, xq + (size_t)b * QKK, bs + 16 * (size_t)b, xs[b], &A, &B);
            }
            float v[8];
            _mm256_storeu_ps(v, _mm256_sub_ps(A, B));
#else
            float A[8] = {0}, B[8] = {0}, v[8];
            for (int b = 0; b < nb; b++)
                x8_block(wg + (size_t)b * XB, xq + (size_t)b * QKK, bs + 16 * (size_t)b, xs[b], A, B);
            for (int r = 0; r < 8; r++) v[r] = A[r] - B[r];
#endif
            for (int r = 0; r < 8; r++) y[(size_t)t * ldy + 8 * g + r] = v[r];
        }
    }
}
