/* GGUF experts on the CPU: the K-quant blocks (Q4_K, Q5_K, Q6_K) decoded and multiplied by int8 activations in
   blocks of 256 (llama.cpp's Q8_K). Numerics and layout: gguf.c's comment. Q4_K rows repacked 8 at a time at load
   run gguf_q4kx8.c instead, with this file's Q4_K numbers (q4k_tile: one exact integer per block). */

#include <math.h>
#include <stdint.h>
#include <string.h>

#include "gguf_kblock.h"

/* A K-quant block's share of a token's 8 fp32 lanes (gguf.h's facc): acc[l] = fma(isum_l, d xs, acc[l]) then
   fma(imin_l, -(dmin xs), acc[l]) (Q6_K: one fma of isum_l - imin_l). */
#if MF_AVX2
INLINE facc facc_add(int type, facc acc, lanes is, lanes im, float dx, float mx) {
    if (type == GG_Q6_K) return _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_sub_epi32(is, im)), _mm256_set1_ps(dx), acc);
    acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(is), _mm256_set1_ps(dx), acc);
    return _mm256_fmadd_ps(_mm256_cvtepi32_ps(im), _mm256_set1_ps(mx), acc);
}
/* facc_add for Q4_K / Q5_K with its two products formed in one multiply: dd = (d, dmin) from the block's two fp16
   fields, (d xs, dmin xs) = dd * xs, and fma(imin, -(dmin xs), acc) as fnmadd(imin, dmin xs, acc) (the same
   rounding of the same exact value): facc_add's bits. */
INLINE __m128 k4_dd(const uint8_t* w) {
    int32_t v;
    memcpy(&v, w, 4);
    return _mm_cvtph_ps(_mm_cvtsi32_si128(v));
}
INLINE facc facc_add_k4(facc acc, lanes is, lanes im, __m128 dd, float xs) {
    const __m256 f = _mm256_castps128_ps256(_mm_mul_ps(dd, _mm_set1_ps(xs)));
    acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(is), _mm256_permutevar8x32_ps(f, _mm256_setzero_si256()), acc);
    return _mm256_fnmadd_ps(_mm256_cvtepi32_ps(im), _mm256_permutevar8x32_ps(f, _mm256_set1_epi32(1)), acc);
}
#else
INLINE facc facc_add(int type, facc acc, lanes is, lanes im, float dx, float mx) {
    for (int l = 0; l < 8; l++) {
        if (type == GG_Q6_K) {
            acc.v[l] = fmaf((float)(is.v[l] - im.v[l]), dx, acc.v[l]);
        } else {
            acc.v[l] = fmaf((float)is.v[l], dx, acc.v[l]);
            acc.v[l] = fmaf((float)im.v[l], mx, acc.v[l]);
        }
    }
    return acc;
}
#endif

/* Q4_K (session 19): a block's 8 integer lanes summed into one exact isum and one imin per token, then across
   blocks A = fma(isum, d xs, A), B = fma(imin, dmin xs, B), y = A - B: the numbers of the 8-row interleaved form
   (gguf_q4kx8.c), which sums each row's block in one register lane. kacc holds (A, B). */
#if MF_AVX2
typedef __m128 kacc;  /* (A, B, 0, 0) */
typedef __m128 kdd;   /* (d, dmin, 0, 0): k4_dd */
INLINE kacc kacc_zero(void) { return _mm_setzero_ps(); }
INLINE kacc kacc_add(kacc acc, lanes is, lanes im, kdd dd, float xs) {
    const __m256i t = _mm256_hadd_epi32(is, im);
    __m128i u = _mm_add_epi32(_mm256_castsi256_si128(t), _mm256_extracti128_si256(t, 1));
    u = _mm_hadd_epi32(u, u);  /* (isum, imin, isum, imin) */
    return _mm_fmadd_ps(_mm_cvtepi32_ps(u), _mm_mul_ps(dd, _mm_set1_ps(xs)), acc);
}
INLINE float kacc_y(kacc acc) { return _mm_cvtss_f32(_mm_sub_ss(acc, _mm_movehdup_ps(acc))); }
#else
typedef struct { float a, b; } kacc;
typedef struct { float d, dmin; } kdd;
INLINE kacc kacc_zero(void) { kacc z = {0.0f, 0.0f}; return z; }
INLINE kacc kacc_add(kacc acc, lanes is, lanes im, kdd dd, float xs) {
    int32_t s = 0, m = 0;
    for (int l = 0; l < 8; l++) { s += is.v[l]; m += im.v[l]; }
    acc.a = fmaf((float)s, dd.d * xs, acc.a);
    acc.b = fmaf((float)m, dd.dmin * xs, acc.b);
    return acc;
}
INLINE float kacc_y(kacc acc) { return acc.a - acc.b; }
#endif

/* A Q4_K block decoded for this ISA's dot product (AVX-512 VNNI: q4kblock's paired sub-blocks; else kblock), and
   its integer sums with one token: the tiles below share these. */
#if MF_AVX512
typedef q4kblock q4kdec;
INLINE void q4k_decode(const uint8_t* w, q4kdec* kb) { decode_q4k_512(w, kb); }
INLINE void q4k_dot(const q4kdec* kb, const int8_t* x, const int16_t* bs, lanes* is, lanes* im) {
    kdotq4k_512(kb, x, bs, is, im);
}
#else
typedef kblock q4kdec;
INLINE void q4k_decode(const uint8_t* w, q4kdec* kb) { decode_q4k(w, kb); }
INLINE void q4k_dot(const q4kdec* kb, const int8_t* x, const int16_t* bs, lanes* is, lanes* im) {
    kdot(kb, x, bs, is, im);
}
#endif

INLINE void q4k_tile(const uint8_t* row, int nb, int t0, int tt, const acts* a, float* y, int ldy) {
    const int K = a->K;
    kacc acc[GTT];
    for (int i = 0; i < tt; i++) acc[i] = kacc_zero();
    for (int b = 0; b < nb; b++) {
        const uint8_t* w = row + (size_t)b * 144;
#if MF_AVX2
        for (int o = 0; o < 144; o += 64) _mm_prefetch((const char*)(w + MF_Q4_PREFETCH + o), _MM_HINT_T0);
        const kdd dd = k4_dd(w);
#else
        const kdd dd = {h2f(w), h2f(w + 2)};
#endif
        const int8_t* xq = a->q + (size_t)b * QKK;
        const int16_t* bs = a->sum + 16 * (size_t)b;
        const float* xs = a->s + b;
        q4kdec kb;
        q4k_decode(w, &kb);
        for (int i = 0; i < tt; i++) {
            lanes is, im;
            q4k_dot(&kb, xq + (size_t)(t0 + i) * K, bs + (size_t)(t0 + i) * (K / 16), &is, &im);
            acc[i] = kacc_add(acc[i], is, im, dd, xs[(size_t)(t0 + i) * (K / QKK)]);
        }
    }
    for (int i = 0; i < tt; i++) y[(size_t)(t0 + i) * ldy] = kacc_y(acc[i]);
}

#if MF_AVX2
/* q4k_tile for tt (a multiple of 4) tokens, 4 tokens' sums reduced at once: r = (isum, imin) of tokens 0 .. 3 as
   8 int32 lanes, then (A, B) of the 4 tokens in one register by one fused multiply-add per lane: kacc_add's
   operations lane by lane, so its bits (the integers are exact in any order). */
INLINE __m256i k4_reduce4(const lanes* is, const lanes* im) {
    const __m256i a = _mm256_hadd_epi32(is[0], im[0]), b = _mm256_hadd_epi32(is[1], im[1]);
    const __m256i c = _mm256_hadd_epi32(is[2], im[2]), d = _mm256_hadd_epi32(is[3], im[3]);
    const __m256i ab = _mm256_hadd_epi32(a, b), cd = _mm256_hadd_epi32(c, d);  /* per 128-bit half: is0 im0 is1 im1 */
    return _mm256_add_epi32(_mm256_permute2x128_si256(ab, cd, 0x20), _mm256_permute2x128_si256(ab, cd, 0x31));
}

INLINE void q4k_tile4(const uint8_t* row, int nb, int t0, int tt, const acts* a, float* y, int ldy) {
    const int K = a->K;
    const __m256i pairs = _mm256_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3);
    __m256 acc[GTT / 4];
    for (int j = 0; j < tt / 4; j++) acc[j] = _mm256_setzero_ps();
    for (int b = 0; b < nb; b++) {
        const uint8_t* w = row + (size_t)b * 144;
        for (int o = 0; o < 144; o += 64) _mm_prefetch((const char*)(w + MF_Q4_PREFETCH + o), _MM_HINT_T0);
        const __m256 dd = _mm256_castpd_ps(_mm256_broadcastsd_pd(_mm_castps_pd(k4_dd(w))));  /* (d, dmin) x 4 */
        const int8_t* xq = a->q + (size_t)b * QKK;
        const int16_t* bs = a->sum + 16 * (size_t)b;
        const float* xs = a->s + b;
        q4kdec kb;
        q4k_decode(w, &kb);
        for (int j = 0; j < tt / 4; j++) {
            lanes is[4], im[4];
            float x4[4];
            for (int i = 0; i < 4; i++) {
                const size_t t = (size_t)(t0 + 4 * j + i);
                q4k_dot(&kb, xq + t * K, bs + t * (K / 16), &is[i], &im[i]);
                x4[i] = xs[t * (K / QKK)];
            }
            const __m256 xv = _mm256_permutevar8x32_ps(_mm256_castps128_ps256(_mm_loadu_ps(x4)), pairs);
            acc[j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(k4_reduce4(is, im)), _mm256_mul_ps(dd, xv), acc[j]);
        }
    }
    for (int j = 0; j < tt / 4; j++) {
        float v[8];
        _mm256_storeu_ps(v, _mm256_sub_ps(acc[j], _mm256_movehdup_ps(acc[j])));  /* A - B in the even lanes */
        for (int i = 0; i < 4; i++) y[(size_t)(t0 + 4 * j + i) * ldy] = v[2 * i];
    }
}
#endif

INLINE void q4k_row(const uint8_t* row, int nb, int T, const acts* a, float* y, int ldy) {
    int t0 = 0;
#if MF_AVX2
    for (; t0 + GTT <= T; t0 += GTT) q4k_tile4(row, nb, t0, GTT, a, y, ldy);
    if (T - t0 >= 4) { q4k_tile4(row, nb, t0, 4, a, y, ldy); t0 += 4; }
#else
    for (; t0 + GTT <= T; t0 += GTT) q4k_tile(row, nb, t0, GTT, a, y, ldy);
    if (T - t0 >= 4) { q4k_tile(row, nb, t0, 4, a, y, ldy); t0 += 4; }
#endif
    if (T - t0 >= 2) { q4k_tile(row, nb, t0, 2, a, y, ldy); t0 += 2; }
    if (T - t0 >= 1) q4k_tile(row, nb, t0, 1, a, y, ldy);
}

/* Row `row` (nb blocks of K-quant `type`: Q5_K, Q6_K) against the tokens t0 .. t0 + tt: y[t * ldy]. `type` and `tt` are
   constants after inlining, so the tile's accumulators stay in registers. */
INLINE void ktile(int type, const uint8_t* row, int nb, int t0, int tt, const acts* a, float* y, int ldy) {
    const int K = a->K, tb = type_bytes(type);
    facc acc[GTT];
    for (int i = 0; i < tt; i++) acc[i] = facc_zero();
    for (int b = 0; b < nb; b++) {
        const uint8_t* w = row + (size_t)b * tb;
#if MF_AVX2
        /* q4.c's distance; Q6_K ran ~12% slower from memory with it into L1 (paired runs, s16), ~10% faster (the
           32000-row head) as a non-temporal prefetch (s17: benchmarks/results/peers/s17/kquant_README.md) */
        for (int o = 0; o < tb; o += 64)
            _mm_prefetch((const char*)(w + MF_Q4_PREFETCH + o), type == GG_Q6_K ? _MM_HINT_NTA : _MM_HINT_T0);
#endif
        const int8_t* xq = a->q + (size_t)b * QKK;
        const int16_t* bs = a->sum + 16 * (size_t)b;
        const float* xs = a->s + b;
#define TOKEN(i) xq + (size_t)(t0 + i) * K, bs + (size_t)(t0 + i) * (K / 16)
#define XS(i) xs[(size_t)(t0 + i) * (K / QKK)]
#if MF_AVX512
        if (type == GG_Q6_K) {
            k6block kb;
            decode_k6_512(w, &kb);
            for (int i = 0; i < tt; i++) {
                lanes is, im;
                kdot6_512(&kb, TOKEN(i), &is, &im);
                acc[i] = facc_add(type, acc[i], is, im, kb.d * XS(i), 0.0f);
            }
        } else {
            k4block kb;
            decode_k4_512(type, w, &kb);
            const __m128 dd = k4_dd(w);
            for (int i = 0; i < tt; i++) {
                lanes is, im;
                kdot4_512(&kb, TOKEN(i), &is, &im);
                acc[i] = facc_add_k4(acc[i], is, im, dd, XS(i));
            }
        }
#else
        kblock kb;
        if (type == GG_Q5_K) decode_q5k(w, &kb);
        else decode_q6k(w, &kb);
#if MF_AVX2
        if (type != GG_Q6_K) {
            const __m128 dd = k4_dd(w);
            for (int i = 0; i < tt; i++) {
                lanes is, im;
                kdot(&kb, TOKEN(i), &is, &im);
                acc[i] = facc_add_k4(acc[i], is, im, dd, XS(i));
            }
            continue;
        }
#endif
        for (int i = 0; i < tt; i++) {
            lanes is, im;
            kdot(&kb, TOKEN(i), &is, &im);
            acc[i] = facc_add(type, acc[i], is, im, kb.d * XS(i), -(kb.dmin * XS(i)));
        }
#endif
#undef TOKEN
#undef XS
    }
    for (int i = 0; i < tt; i++) y[(size_t)(t0 + i) * ldy] = facc_sum(acc[i]);
}

/* All T tokens in tiles of 8, then one of 4, 2 and 1 as needed (a block is decoded once per tile). */
INLINE void krow(int type, const uint8_t* row, int nb, int T, const acts* a, float* y, int ldy) {
    int t0 = 0;
    for (; t0 + GTT <= T; t0 += GTT) ktile(type, row, nb, t0, GTT, a, y, ldy);
    if (T - t0 >= 4) { ktile(type, row, nb, t0, 4, a, y, ldy); t0 += 4; }
    if (T - t0 >= 2) { ktile(type, row, nb, t0, 2, a, y, ldy); t0 += 2; }
    if (T - t0 >= 1) ktile(type, row, nb, t0, 1, a, y, ldy);
}

void mf_gguf_krows(int type, const uint8_t* w, int64_t stride, int n0, int n1, int nb, int T, const acts* a, float* y,
                   int ldy) {
    switch (type) {  /* one copy of the row loop per type, its decode inlined (no call per row) */
        case GG_Q4_K:
            for (int n = n0; n < n1; n++) q4k_row(w + (size_t)n * stride, nb, T, a, y + n, ldy);
            break;
        case GG_Q5_K:
            for (int n = n0; n < n1; n++) krow(GG_Q5_K, w + (size_t)n * stride, nb, T, a, y + n, ldy);
            break;
        default:
            for (int n = n0; n < n1; n++) krow(GG_Q6_K, w + (size_t)n * stride, nb, T, a, y + n, ldy);
            break;
    }
}
