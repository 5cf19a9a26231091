/* Load-time layout conversion of packed 4-bit weights without unpacking a nibble (issue 37).

   Every conversion moeflow does at load from AWQ's qweight (int32 [K, N/8], 8 columns per word) to a
   K-contiguous layout (the GPU pool's panels, the CPU q4 rows) is an 8 x 8 transpose of nibbles: 8 rows of one
   word give the 8 words of 8 columns, each holding those 8 rows. It is done in registers with three rounds of
   swaps (16-bit, 8-bit, then 4-bit blocks: shift, xor, and), the output words then stored where the layout
   wants them: out[col_off[8c + i] + k_off[kb]] is word i of block (kb, c) (col_off folds in the input's nibble
   order and any column permutation, k_off the panel/row-group layout). The plain-torch twin (the same rounds on
   whole tensors) and the tests comparing both to the unpacking reference are in moeflow/kernels/repack.py. */

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "native.h"

static inline void mf_transpose8(uint32_t x[8]) {
    for (int r = 0; r < 4; r++) {  /* 4x4 blocks of nibbles: upper-right <-> lower-left */
        const uint32_t t = ((x[r] >> 16) ^ x[r + 4]) & 0x0000FFFFu;
        x[r] ^= t << 16;
        x[r + 4] ^= t;
    }
    for (int r = 0; r < 8; r += (r & 1) ? 3 : 1) {  /* r = 0, 1, 4, 5: 2x2 blocks */
        const uint32_t t = ((x[r] >> 8) ^ x[r + 2]) & 0x00FF00FFu;
        x[r] ^= t << 8;
        x[r + 2] ^= t;
    }
    for (int r = 0; r < 8; r += 2) {  /* single nibbles */
        const uint32_t t = ((x[r] >> 4) ^ x[r + 1]) & 0x0F0F0F0Fu;
        x[r] ^= t << 4;
        x[r + 1] ^= t;
    }
}

#ifdef __AVX512F__
#include <immintrin.h>

static inline void mf_swap16(__m512i *a, __m512i *b, int shift, int mask) {
    const __m512i t = _mm512_and_si512(_mm512_xor_si512(_mm512_srli_epi32(*a, shift), *b), _mm512_set1_epi32(mask));
    *a = _mm512_xor_si512(*a, _mm512_slli_epi32(t, shift));
    *b = _mm512_xor_si512(*b, t);
}

/* mf_transpose8 in each of 16 lanes: word r of lane l is x[r]'s lane l */
static inline void mf_transpose8x16(__m512i x[8]) {
    for (int r = 0; r < 4; r++)
        mf_swap16(&x[r], &x[r + 4], 16, 0x0000FFFF);
    mf_swap16(&x[0], &x[2], 8, 0x00FF00FF);
    mf_swap16(&x[1], &x[3], 8, 0x00FF00FF);
    mf_swap16(&x[4], &x[6], 8, 0x00FF00FF);
    mf_swap16(&x[5], &x[7], 8, 0x00FF00FF);
    for (int r = 0; r < 8; r += 2)
        mf_swap16(&x[r], &x[r + 1], 4, 0x0F0F0F0F);
}
#endif

/* in: uint32 [rows, cols] (rows % 8 == 0); row_order[8]: nibble i of an output word holds input row
   8kb + row_order[i]; col_t int32 [8, cols]: where word i of column block c goes (col_t[i * cols + c]: from
   nibble i of input word c); k_off int64 [rows / 8]: added for block row kb; out: uint32, every word written
   once (the offsets fit in int32: checked by the caller). */
void mf_nibble_transpose(const uint32_t *in, int64_t rows, int64_t cols, const int32_t *row_order,
                         const int32_t *col_t, const int64_t *k_off, uint32_t *out) {
    /* tiles of 16 block rows (whole 64-byte output lines) x 64 words: the 128 input rows of a tile, K-strided
       (often by a multiple of 4 KiB, which maps them onto a few L1 sets), stay in L2 and each row is read
       sequentially */
    const int64_t nkb = rows / 8, block = 32, tile = 16;
    for (int64_t kb0 = 0; kb0 < nkb; kb0 += block) {
        const int64_t kb1 = kb0 + block < nkb ? kb0 + block : nkb;
        for (int64_t c0 = 0; c0 < cols; c0 += tile) {
            const int64_t c1 = c0 + tile < cols ? c0 + tile : cols;
            for (int64_t kb = kb0; kb < kb1; kb++) {
                const uint32_t *src[8];
                for (int r = 0; r < 8; r++)
                    src[r] = in + (8 * kb + row_order[r]) * cols;
                uint32_t *dst = out + k_off[kb];
                int64_t c = c0;
#ifdef __AVX512F__
                for (; c + 16 <= c1; c += 16) {  /* 16 column words at once: the same swaps, one lane each */
                    __m512i x[8];
                    for (int r = 0; r < 8; r++)
                        x[r] = _mm512_loadu_si512((const void *)(src[r] + c));
                    mf_transpose8x16(x);
                    for (int i = 0; i < 8; i++)
                        _mm512_i32scatter_epi32((void *)dst, _mm512_loadu_si512((const void *)(col_t + i * cols + c)),
                                                x[i], 4);
                }
#endif
                for (; c < c1; c++) {
                    uint32_t x[8];
                    for (int r = 0; r < 8; r++)
                        x[r] = src[r][c];
                    mf_transpose8(x);
                    for (int i = 0; i < 8; i++)
                        dst[col_t[i * cols + c]] = x[i];
                }
            }
        }
    }
}

/* The same transpose for layouts that keep a column's words together (q4.c's row groups):
   out[c * c_stride + 8 * kb + col_pos[i]] = word i of block (kb, c). Walks 16 columns at a time down all of K,
   so each input line is read once and every column's output is one sequential stream; with AVX-512 the 8 x 16
   words of a step are transposed in registers into 16 runs of 8 words (no scatter). */
void mf_nibble_transpose_grouped(const uint32_t *in, int64_t rows, int64_t cols, const int32_t *row_order,
                                 const int32_t *col_pos, int64_t c_stride, uint32_t *out) {
    const int64_t nkb = rows / 8;
    int64_t c0 = 0;
#ifdef __AVX512F__
    int32_t inv[8];  /* output position p holds word inv[p] */
    for (int i = 0; i < 8; i++)
        inv[col_pos[i]] = i;
    for (; c0 + 16 <= cols; c0 += 16) {
        for (int64_t kb = 0; kb < nkb; kb++) {
            __m512i x[8], t[8], u[8];
            for (int r = 0; r < 8; r++)
                x[r] = _mm512_loadu_si512((const void *)(in + (8 * kb + row_order[r]) * cols + c0));
            mf_transpose8x16(x);
            /* rows in output order, then an 8 x 16 -> 16 x 8 transpose within 128-bit lanes */
            for (int h = 0; h < 2; h++) {
                const __m512i a = x[inv[4 * h]], b = x[inv[4 * h + 1]], c = x[inv[4 * h + 2]], d = x[inv[4 * h + 3]];
                t[4 * h] = _mm512_unpacklo_epi32(a, b);
                t[4 * h + 1] = _mm512_unpackhi_epi32(a, b);
                t[4 * h + 2] = _mm512_unpacklo_epi32(c, d);
                t[4 * h + 3] = _mm512_unpackhi_epi32(c, d);
                u[4 * h] = _mm512_unpacklo_epi64(t[4 * h], t[4 * h + 2]);      /* lanes 4q:   positions 4h..4h+3 */
                u[4 * h + 1] = _mm512_unpackhi_epi64(t[4 * h], t[4 * h + 2]);  /* lanes 4q+1 */
                u[4 * h + 2] = _mm512_unpacklo_epi64(t[4 * h + 1], t[4 * h + 3]);
                u[4 * h + 3] = _mm512_unpackhi_epi64(t[4 * h + 1], t[4 * h + 3]);
            }
            uint32_t *dst = out + c0 * c_stride + 8 * kb;
            for (int m = 0; m < 4; m++) {
                __m128i lo[4], hi[4];
                _mm512_storeu_si512((void *)lo, u[m]);
                _mm512_storeu_si512((void *)hi, u[4 + m]);
                for (int q = 0; q < 4; q++) {
                    uint32_t *o = dst + (4 * q + m) * c_stride;
                    _mm_storeu_si128((__m128i *)o, lo[q]);
                    _mm_storeu_si128((__m128i *)(o + 4), hi[q]);
                }
            }
        }
    }
#endif
    for (; c0 < cols; c0++) {
        for (int64_t kb = 0; kb < nkb; kb++) {
            uint32_t x[8];
            for (int r = 0; r < 8; r++)
                x[r] = in[(8 * kb + row_order[r]) * cols + c0];
            mf_transpose8(x);
            uint32_t *dst = out + c0 * c_stride + 8 * kb;
            for (int i = 0; i < 8; i++)
                dst[col_pos[i]] = x[i];
        }
    }
}

/* A fixed permutation of the 32 bits of every word (MXFP4 blocks into the kernel layout,
   moeflow/kernels/mxfp4_reference.py), given as two 16-bit tables: out = lo[w & 0xFFFF] | hi[w >> 16]. Done as
   four 8-bit lookups into 4 KiB of tables derived from them (L1-resident, where the 16-bit ones take 512 KiB). */
void mf_permute_word_bits(const uint32_t *in, int64_t n, const uint32_t *lo, const uint32_t *hi, uint32_t *out) {
    uint32_t t[4][256];
    for (int v = 0; v < 256; v++) {
        t[0][v] = lo[v];
        t[1][v] = lo[v << 8];
        t[2][v] = hi[v];
        t[3][v] = hi[v << 8];
    }
    for (int64_t i = 0; i < n; i++) {
        const uint32_t w = in[i];
        out[i] = t[0][w & 0xFF] | t[1][(w >> 8) & 0xFF] | t[2][(w >> 16) & 0xFF] | t[3][w >> 24];
    }
}

/* Per-row int8 quantization of an fp32 matrix [rows, cols] (the CPU path's lm_head at load), bit for bit the
   torch expression it replaces (moeflow/kernels/cpu/quant_linear.py): s = bf16(max(max|w| / 127, 1e-8)) (round
   to nearest even), q = clamp(nearbyint(w / s), -127, 127). scales_bf16: uint16 [rows], q: int8 [rows, cols]. */
#include <math.h>

/* The scale of one row (its bf16 bits; *sf: that bf16 as a float) and the row's codes, written at q[c]'s place
   pos(c) by the callers: shared by the plain and the grouped quantizers so their numbers are the same. */
static inline uint16_t mf_row_scale_int8(const float *row, int64_t cols, float *sf) {
    float amax = 0.0f;
    for (int64_t c = 0; c < cols; c++) {
        const float a = fabsf(row[c]);
        amax = a > amax ? a : amax;
    }
    float s = amax / 127.0f;
    s = s < 1e-8f ? 1e-8f : s;
    uint32_t bits;
    memcpy(&bits, &s, 4);
    bits += 0x7FFFu + ((bits >> 16) & 1u);  /* round to nearest even (s is finite and positive) */
    const uint16_t b = (uint16_t)(bits >> 16);
    uint32_t sb = (uint32_t)b << 16;
    memcpy(sf, &sb, 4);
    return b;
}

static inline int8_t mf_code_int8(float w, float sf) {
    float v = nearbyintf(w / sf);
    v = v > 127.0f ? 127.0f : (v < -127.0f ? -127.0f : v);
    return (int8_t)v;
}

void mf_quantize_rows_int8(const float *w, int64_t rows, int64_t cols, uint16_t *scales_bf16, int8_t *q) {
    for (int64_t r = 0; r < rows; r++) {
        const float *row = w + r * cols;
        float sf;
        scales_bf16[r] = mf_row_scale_int8(row, cols, &sf);
        int8_t *out = q + r * cols;
        for (int64_t c = 0; c < cols; c++) out[c] = mf_code_int8(row[c], sf);
    }
}

/* Row r of a 16- or 32-bit matrix (kind MF_ROWS_F32 / _F16 / _BF16) widened to fp32, exactly. */
#define MF_ROWS_F32 0
#define MF_ROWS_F16 1
#define MF_ROWS_BF16 2
static void mf_widen_row(const void *w, int kind, int64_t r, int64_t cols, float *out) {
    if (kind == MF_ROWS_F32) {
        memcpy(out, (const float *)w + r * cols, (size_t)cols * 4);
        return;
    }
    const uint16_t *row = (const uint16_t *)w + r * cols;
    int64_t c = 0;
    if (kind == MF_ROWS_BF16) {
        for (; c < cols; c++) {
            const uint32_t bits = (uint32_t)row[c] << 16;
            memcpy(out + c, &bits, 4);
        }
        return;
    }
#ifdef __F16C__
    for (; c + 8 <= cols; c += 8)
        _mm256_storeu_ps(out + c, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(row + c))));
#endif
    for (; c < cols; c++) out[c] = mf_half_to_float(row[c]);
}

/* mf_quantize_rows_int8 of a matrix as stored (fp32, fp16 or bf16: widened exactly, a row at a time), its codes
   written straight into q8.c's layout: in each group of 8 rows, per 32-feature block b, bytes [c, r, j] = row
   r's feature 32b + 4c + j; the last rows % 8 rows plain (moeflow/kernels/cpu/native.py, _group_q8). cols % 32
   == 0. The rows' groups are spread over nthreads threads. Returns 0, or 1 when a buffer cannot be had. */
int mf_quantize_rows_int8_grouped(const void *w, int kind, int64_t rows, int64_t cols, uint16_t *scales_bf16,
                                  int8_t *q, int nthreads) {
    const int64_t groups = (rows + Q8_GROUP - 1) / Q8_GROUP;
    int failed = 0;
#pragma omp parallel num_threads(nthreads)
    {
        float *row = (float *)malloc((size_t)cols * sizeof(float));
        int8_t *codes = (int8_t *)malloc((size_t)cols);
        if (!row || !codes) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(static)
        for (int64_t g = 0; g < groups; g++) {
            if (!row || !codes) continue;
            const int64_t r0 = g * Q8_GROUP, n = rows - r0 < Q8_GROUP ? rows - r0 : Q8_GROUP;
            int8_t *base = q + r0 * cols;
            for (int64_t i = 0; i < n; i++) {
                float sf;
                mf_widen_row(w, kind, r0 + i, cols, row);
                scales_bf16[r0 + i] = mf_row_scale_int8(row, cols, &sf);
                int8_t *out = n < Q8_GROUP ? base + i * cols : codes;  /* the plain tail: in place */
                for (int64_t c = 0; c < cols; c++) out[c] = mf_code_int8(row[c], sf);  /* (vectorized) */
                if (n < Q8_GROUP) continue;
                for (int64_t b = 0; b < cols / QB; b++)  /* 4 codes at a time to their place in the group */
                    for (int c = 0; c < QB / 4; c++)
                        memcpy(base + b * QB * Q8_GROUP + c * 4 * Q8_GROUP + i * 4, codes + b * QB + c * 4, 4);
            }
        }
        free(row);
        free(codes);
    }
    return failed;
}

/* Q4_0 rows straight into AWQ's qweight and scales (GGUF experts as the AWQ format, moeflow/io/gguf/experts.py),
   moving packed words: a Q4_0 block is an fp16 scale d and 16 bytes whose low nibbles are elements 0-15 and high
   nibbles 16-31, so 32-bit word ww of a block holds, in nibble 2j + h, element 4 ww + j + 16 h. The same 8 x 8
   transpose as above turns word ww of 8 rows into 8 words of one element each, holding those rows: AWQ's word
   (k, c) once the rows are taken in row_order (AWQ_ORDER). raw: uint8 [n, k / 32 * 18] (n % 8 == 0, k % 32 == 0),
   rows contiguous; qweight: uint32, word (k, c) at qweight[k * ld + c]; scales: uint16, block b of row m at
   scales[b * lds + m]. Walks 16 row groups (128 rows) at a time down all of K: each output row's 16 words of a
   step are one 64-byte store, and each input row is read sequentially (unaligned: blocks are 18 bytes). */
void mf_q4_0_to_awq(const uint8_t *raw, int64_t n, int64_t k, const int32_t *row_order, uint32_t *qweight,
                    int64_t ld, uint16_t *scales, int64_t lds) {
    const int64_t nb = k / 32, row_bytes = nb * 18, groups = n / 8;
    int64_t c0 = 0;
#ifdef __AVX512F__
    int32_t idx[8][16];  /* byte offset of row 8 l + row_order[r] from row 8 c0 */
    for (int r = 0; r < 8; r++)
        for (int l = 0; l < 16; l++)
            idx[r][l] = (int32_t)((8 * l + row_order[r]) * row_bytes);
    if (16 * 8 * row_bytes < INT32_MAX) {
        __m512i vidx[8];
        for (int r = 0; r < 8; r++)
            vidx[r] = _mm512_loadu_si512((const void *)idx[r]);
        for (; c0 + 16 <= groups; c0 += 16) {
            const uint8_t *base = raw + 8 * c0 * row_bytes;
            for (int64_t b = 0; b < nb; b++) {
                for (int ww = 0; ww < 4; ww++) {
                    __m512i x[8];
                    for (int r = 0; r < 8; r++)
                        x[r] = _mm512_i32gather_epi32(vidx[r], (const void *)(base + 18 * b + 2 + 4 * ww), 1);
                    mf_transpose8x16(x);
                    for (int i = 0; i < 8; i++) {
                        const int64_t e = 32 * b + 4 * ww + (i >> 1) + 16 * (i & 1);
                        _mm512_storeu_si512((void *)(qweight + e * ld + c0), x[i]);
                    }
                }
                for (int64_t m = 0; m < 128; m++)
                    memcpy(scales + b * lds + 8 * c0 + m, base + m * row_bytes + 18 * b, 2);
            }
        }
    }
#endif
    for (; c0 < groups; c0++) {
        const uint8_t *src[8];
        for (int r = 0; r < 8; r++)
            src[r] = raw + (8 * c0 + row_order[r]) * row_bytes;
        for (int64_t b = 0; b < nb; b++) {
            for (int ww = 0; ww < 4; ww++) {
                uint32_t x[8];
                for (int r = 0; r < 8; r++)
                    memcpy(&x[r], src[r] + 18 * b + 2 + 4 * ww, 4);
                mf_transpose8(x);
                for (int i = 0; i < 8; i++)
                    qweight[(32 * b + 4 * ww + (i >> 1) + 16 * (i & 1)) * ld + c0] = x[i];
            }
            for (int m = 0; m < 8; m++)
                memcpy(scales + b * lds + 8 * c0 + m, raw + (8 * c0 + m) * row_bytes + 18 * b, 2);
        }
    }
}

/* GGUF Q4_0 rows straight into q4.c's layout, MF_Q4_F16Z8 form (q4.c's file comment; issue 37's cold start: one
   pass over the stored blocks, no AWQ intermediate). raw: n rows of k / 32 blocks (fp16 d, then 16 bytes: byte j
   = code j | code 16 + j << 4), rows contiguous; packed: uint8 [n, k / 2], scales uint16 [n, k / 32], both in
   q4.c's row-grouped order. Rows [row0, row1) are written (row0, row1 multiples of 8 or n): callers may split a
   matrix between threads. In a row group, vector c of block b holds codes 8c + j (low nibble) and 8c + 4 + j
   (high) of row r at byte 4r + j; with w0..w3 the block's 4 words of bytes, P0 = lo(w0) | lo(w1) << 4,
   P1 = lo(w2) | lo(w3) << 4, P2 = hi(w0) >> 4 | hi(w1), P3 = hi(w2) >> 4 | hi(w3): word moves and masks. Each
   input row is read in order, its words stored 32 bytes apart into the group's 8 * k / 2 bytes (cache-resident
   at Mixtral's sizes); 2.0-2.5 GB/s of input on the loaded 2-core EPYC against memcpy's ~4 (an AVX-512 gather of
   the 8 rows' words per block measured 1.3-1.9). The last n % 8 rows are plain rows, whose bytes are Q4_0's own. */
void mf_q4_0_to_q4z(const uint8_t *raw, int64_t n, int64_t k, int64_t row0, int64_t row1, uint8_t *packed,
                    uint16_t *scales) {
    const int64_t nb = k / 32, row_bytes = nb * 18, whole = n - n % 8;
    const uint32_t lo = 0x0F0F0F0Fu, hi = 0xF0F0F0F0u;
    int64_t r0 = row0;
    for (; r0 + 8 <= row1 && r0 + 8 <= whole; r0 += 8) {
        for (int r = 0; r < 8; r++) {
            const uint8_t *src = raw + (r0 + r) * row_bytes;
            uint32_t *dst = (uint32_t *)(packed + r0 * (k / 2)) + r;
            uint16_t *sd = scales + r0 * nb + r;
            for (int64_t b = 0; b < nb; b++, src += 18, dst += 32, sd += 8) {
                uint32_t w[4];
                memcpy(w, src + 2, 16);
                memcpy(sd, src, 2);
                dst[0] = (w[0] & lo) | (w[1] & lo) << 4;
                dst[8] = (w[2] & lo) | (w[3] & lo) << 4;
                dst[16] = (w[0] & hi) >> 4 | (w[1] & hi);
                dst[24] = (w[2] & hi) >> 4 | (w[3] & hi);
            }
        }
    }
    for (int64_t m = r0; m < row1; m++)  /* tail rows: the stored bytes */
        for (int64_t b = 0; b < nb; b++) {
            memcpy(packed + m * (k / 2) + 16 * b, raw + m * row_bytes + 18 * b + 2, 16);
            memcpy(scales + m * nb + b, raw + m * row_bytes + 18 * b, 2);
        }
}
