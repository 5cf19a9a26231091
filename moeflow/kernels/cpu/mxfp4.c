/* MXFP4 experts (gpt-oss) on the CPU, read as the host store holds them: an expert's region (MXFP4Format's kernel
   layout) computed in place, no converted copy. Binding and fp32 model: moeflow/kernels/cpu/mxfp4_native.py.

   The region of one matrix W [N, K] (moeflow/kernels/experts/mxfp4_reference.py): blocks [K/P, N, P/32, 16] and
   e8m0 scales [K/P, N, P/32] (panels of P = 64 or 32 inputs), 32 e2m1 codes per 16-byte block whose bits are
   permuted within each 32-bit word for the Triton kernel: in each 16-bit half of a word four codes sit at
     A (m, e0, e1, s) = bits (6, 7, 8, 15), B = (3, 4, 5, 12), C = (0, 1, 2, 9), D = (10, 13, 14, 11)
   (codes 0, 2, 4, 6 of the word in its low half, 1, 3, 5, 7 in its high half, KERNEL_BITS). A few shifts and masks
   per 16-bit lane give each code's 4-bit e2m1 index (s e1 e0 m) in a byte of its own: C | B << 8 and A | D << 8,
   so a word's 8 codes land in one 32-bit lane of two registers, in the order (4, 2, 5, 3) and (0, 6, 1, 7). With
   AVX-512 VBMI and BITALG (Zen 4, Ice Lake on) two rows at once, the same bytes in the same order from
   vpmultishiftqb (each code's bit field into a byte), vpermb (field -> |2 e2m1|) and vpshufbitqmb (the sign bits
   into a mask): 7 instructions per 128 codes instead of ~30 per 64 (one gpt-oss-120b w13: 1.1 -> 0.7 ms, ~12 GB/s
   on one Zen 4 core).

   The technique of llama.cpp's CPU MXFP4 x Q8_0 dot product: a 16-entry int8 table of doubled e2m1 values
   (0, 1, 2, 3, 4, 6, 8, 12 and their negatives: pshufb), activations quantized to int8 per block of 32 (scale
   xs = max|x| / 127, round half to even, as gguf.c), |w| x sign(x, w) summed exactly in int32 (vpdpbusd on AVX-512
   VNNI, maddubs + pmaddwd on AVX2, C loops on the portable build), and the block's factor 2^(e - 127) / 2 times xs.
   The activations are stored permuted the way the codes come out of the decode, once per token (mx_acts_row).

   Numerics, the same operations on every build and whatever the batch (tests/test_cpu_isa.py compares bits):
   per row, token and pair of blocks (2bp, 2bp + 1) eight exact int32 lane sums, lane l the 8 codes of word l of the
   pair (lanes 0-3 block 2bp, 4-7 block 2bp + 1); each lane added to its fp32 lane by one fused multiply-add with
   fp32(xs_b * 2^(e_b - 128)); the 8 lanes summed once per row as ((a0 + a4) + (a2 + a6)) + ((a1 + a5) + (a3 + a7)).
   The activations' quantization and the expert's epilogue (biases, the gate activation, the routing weight) are in
   mxfp4_epilogue.c, the declarations both files share in mxfp4.h. */

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "mxfp4.h"

#ifndef MX_ACC
#define MX_ACC 16384  /* fp32 accumulators of a tile (64 KB): rows x tokens x 8 lanes */
#endif
#define MX_TT 4       /* tokens per tile: a block pair is decoded once per row and tile */
#ifndef MX_PF
#define MX_PF 1       /* software prefetch: the blocks (and scales) this many panels on, into L2 */
#endif
#ifndef MX_HINT
#define MX_HINT _MM_HINT_T1
#endif

static const int8_t VALUES[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};  /* 2 x e2m1 */

typedef struct {  /* one matrix W [N, K] in the region layout */
    const uint8_t* blocks;
    const uint8_t* scales;
    int N, K, bpp;  /* bpp: blocks per panel (P / 32) */
} mxmat;

/* 2^(e - 128) as a float (e8m0 halved: the table holds doubled values), exactly, subnormal for e < 2. */
MXI float e8_half(uint8_t e) {
    const uint32_t bits = e >= 2 ? (uint32_t)(e - 1) << 23 : 0x200000u << e;
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

/* ---- one block pair ---------------------------------------------------------------------------------------- */

#if MF_AVX2
typedef __m256 lanes;
MXI lanes lanes_zero(void) { return _mm256_setzero_ps(); }
MXI lanes lanes_load(const float* p) { return _mm256_loadu_ps(p); }
MXI void lanes_store(float* p, lanes a) { _mm256_storeu_ps(p, a); }
MXI float lanes_sum(lanes a) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}
typedef struct { __m256i mag0, mag1, val0, val1; } decoded;

/* 32 bytes (blocks 2bp at lo, 2bp + 1 at hi) -> the codes' |2 e2m1| and 2 e2m1 in the two registers' orders. */
MXI decoded decode(const uint8_t* lo, const uint8_t* hi) {
    const __m256i w = _mm256_inserti128_si256(_mm256_castsi128_si256(_mm_loadu_si128((const __m128i*)lo)),
                                              _mm_loadu_si128((const __m128i*)hi), 1);
    const __m256i m7 = _mm256_set1_epi16(7), m8 = _mm256_set1_epi16(8);
    const __m256i s6 = _mm256_srli_epi16(w, 6), s12 = _mm256_srli_epi16(w, 12);
    const __m256i c = _mm256_or_si256(_mm256_and_si256(w, m7), _mm256_and_si256(s6, m8));
    const __m256i b = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(w, 3), m7),
                                      _mm256_and_si256(_mm256_srli_epi16(w, 9), m8));
    const __m256i a = _mm256_or_si256(_mm256_and_si256(s6, m7), _mm256_and_si256(s12, m8));
    const __m256i d = _mm256_or_si256(
        _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(w, 10), _mm256_set1_epi16(1)),
                        _mm256_and_si256(s12, _mm256_set1_epi16(6))),
        _mm256_and_si256(_mm256_srli_epi16(w, 8), m8));
    const __m256i p0 = _mm256_or_si256(c, _mm256_slli_epi16(b, 8)), p1 = _mm256_or_si256(a, _mm256_slli_epi16(d, 8));
    const __m256i vt = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i*)VALUES));
    const __m256i mt = _mm256_abs_epi8(vt);
    decoded r = {_mm256_shuffle_epi8(mt, p0), _mm256_shuffle_epi8(mt, p1), _mm256_shuffle_epi8(vt, p0),
                 _mm256_shuffle_epi8(vt, p1)};
    return r;
}

/* lanes += (the 8 exact word sums of the decoded pair times the token's codes xp[0 .. 63]) * (xs8 * e8): xs8 the
   token's (xs0 x4, xs1 x4), e8 the blocks' (2^(e0 - 128) x4, 2^(e1 - 128) x4), multiplied in fp32 per lane. */
MXI lanes make_e(float f0, float f1) { return _mm256_set_m128(_mm_set1_ps(f1), _mm_set1_ps(f0)); }

MXI lanes pair_add(lanes acc, const decoded* w, const int8_t* xp, const float* xs8, lanes e8) {
    const __m256i x0 = _mm256_sign_epi8(_mm256_loadu_si256((const __m256i*)xp), w->val0);
    const __m256i x1 = _mm256_sign_epi8(_mm256_loadu_si256((const __m256i*)(xp + 32)), w->val1);
#if MF_AVX512
    const __m256i dot = _mm256_dpbusd_epi32(_mm256_dpbusd_epi32(_mm256_setzero_si256(), w->mag0, x0), w->mag1, x1);
#else
    const __m256i dot = _mm256_madd_epi16(_mm256_add_epi16(_mm256_maddubs_epi16(w->mag0, x0),
                                                           _mm256_maddubs_epi16(w->mag1, x1)),
                                          _mm256_set1_epi16(1));
#endif
    return _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_mul_ps(_mm256_loadu_ps(xs8), e8), acc);
}
#if MF_AVX512 && defined(__AVX512VBMI__) && defined(__AVX512BITALG__)
#define MX_PAIR2 1
/* Two rows' pairs in one 512-bit register (row A's blocks in the low half, row B's in the high: the same bytes and
   lanes as two decode() calls), the sign kept as a mask: x negated where the code's sign bit is set (|w| = 0 for
   -0, so the word sums are decode()'s, exactly). */
typedef struct { __m512i mag0, mag1; __mmask64 neg0, neg1; } decoded2;

MXI __m512i load4x16(const uint8_t* alo, const uint8_t* ahi, const uint8_t* blo, const uint8_t* bhi) {
    __m512i w = _mm512_castsi128_si512(_mm_loadu_si128((const __m128i*)alo));
    w = _mm512_inserti32x4(w, _mm_loadu_si128((const __m128i*)ahi), 1);
    w = _mm512_inserti32x4(w, _mm_loadu_si128((const __m128i*)blo), 2);
    return _mm512_inserti32x4(w, _mm_loadu_si128((const __m128i*)bhi), 3);
}

/* With VBMI and BITALG (Zen 4, Ice Lake and later): vpmultishiftqb gathers each code's bit field into a byte of
   its own, in decode()'s byte order (register 0: C lo, B lo, C hi, B hi of each word; register 1: A lo, D lo, A hi,
   D hi), vpermb maps fields to |2 e2m1| (bits of other codes in a field are ignored by the tables), and
   vpshufbitqmb gathers the sign bits into the masks: 7 instructions for 128 codes. */
static const uint8_t MS0[8] = {0, 3, 16, 19, 32, 35, 48, 51}, MS1[8] = {6, 10, 22, 26, 38, 42, 54, 58};
static const uint8_t SG0[8] = {9, 12, 25, 28, 41, 44, 57, 60}, SG1[8] = {15, 11, 31, 27, 47, 43, 63, 59};

MXI __m512i bcast8(const uint8_t* p) { uint64_t v; memcpy(&v, p, 8); return _mm512_set1_epi64((long long)v); }

/* field (6 bits) -> |2 e2m1|: T7 of a magnitude code in bits 0-2 (A, B, C), TD of D's (m at bit 0, e at 3-4) */
static const uint8_t T7[64] __attribute__((aligned(64))) = {
    0, 1, 2, 3, 4, 6, 8, 12, 0, 1, 2, 3, 4, 6, 8, 12, 0, 1, 2, 3, 4, 6, 8, 12, 0, 1, 2, 3, 4, 6, 8, 12, 0, 1, 2, 3,
    4, 6, 8, 12, 0, 1, 2, 3, 4, 6, 8, 12, 0, 1, 2, 3, 4, 6, 8, 12, 0, 1, 2, 3, 4, 6, 8, 12};
static const uint8_t TD[64] __attribute__((aligned(64))) = {
    0, 1, 0, 1, 0, 1, 0, 1, 2, 3, 2, 3, 2, 3, 2, 3, 4, 6, 4, 6, 4, 6, 4, 6, 8, 12, 8, 12, 8, 12, 8, 12, 0, 1, 0, 1,
    0, 1, 0, 1, 2, 3, 2, 3, 2, 3, 2, 3, 4, 6, 4, 6, 4, 6, 4, 6, 8, 12, 8, 12, 8, 12, 8, 12};

MXI decoded2 decode2(__m512i w) {
    const __m512i f0 = _mm512_multishift_epi64_epi8(bcast8(MS0), w);
    const __m512i f1 = _mm512_multishift_epi64_epi8(bcast8(MS1), w);
    const __m512i lut7 = _mm512_load_si512(T7), lutd = _mm512_load_si512(TD);
    decoded2 r = {_mm512_permutexvar_epi8(f0, lut7),
                  _mm512_mask_permutexvar_epi8(_mm512_permutexvar_epi8(f1, lut7), 0xAAAAAAAAAAAAAAAAull, f1, lutd),
                  _mm512_bitshuffle_epi64_mask(w, bcast8(SG0)), _mm512_bitshuffle_epi64_mask(w, bcast8(SG1))};
    return r;
}

/* e8_half of 4 scales (bytes of e4) each in 4 lanes, (0 1 2 3) -> lanes 0-3, 4-7, 8-11, 12-15; the same bits
   (e >= 2: (e - 1) << 23, else 0x200000 << e); lanes of bytes 1 and 3 zero when odd (no block 2bp + 1). */
MXI __m512i e8_bits16(__m512i e) {  /* 16 lanes of e (0 .. 255) -> the bits of e8_half(e) */
    const __m512i big = _mm512_slli_epi32(_mm512_sub_epi32(e, _mm512_set1_epi32(1)), 23);
    const __m512i small = _mm512_sllv_epi32(_mm512_set1_epi32(0x200000), e);
    return _mm512_mask_blend_epi32(_mm512_cmpge_epu32_mask(e, _mm512_set1_epi32(2)), small, big);
}
MXI __m512 e8_half16(uint32_t e4, int odd) {
    const __m128i idx = _mm_setr_epi8(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3);
    const __m512i bits = e8_bits16(_mm512_cvtepu8_epi32(_mm_shuffle_epi8(_mm_cvtsi32_si128((int)e4), idx)));
    return _mm512_castsi512_ps(_mm512_maskz_mov_epi32(odd ? 0x0F0F : 0xFFFF, bits));
}
/* P = 64: rows r .. r + 7's 16 scale bytes (2bp, 2bp + 1 of each row) -> e8_half of byte k in lane k; row pair j's
   e8_half16 is then lanes 4j + (l / 4) (e16_of) */
MXI __m512 e8_half_rows8(const uint8_t* sc) {
    return _mm512_castsi512_ps(e8_bits16(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)sc))));
}
MXI __m512 e16_of(__m512 f, int j) {
    const __m512i quad = _mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3);
    return _mm512_permutexvar_ps(_mm512_add_epi32(quad, _mm512_set1_epi32(4 * j)), f);
}

/* The 16 lanes of rows A and B (acc: A's 8 then B's) += word sums * (xs8 * e16), as pair_add per row. */
typedef struct { __m512i x0, x1; __m512 xs; } token2;  /* a token's pair codes and xs8, in both halves */

MXI token2 token_load2(const int8_t* xp, const float* xs8) {
    token2 t = {_mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i*)xp)),
                _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i*)(xp + 32))),
                _mm512_castpd_ps(_mm512_broadcast_f64x4(_mm256_castps_pd(_mm256_loadu_ps(xs8))))};
    return t;
}

MXI __m512 pair_dot2(const decoded2* w, const token2* t) {  /* the 16 exact word sums, as floats */
    const __m512i zero = _mm512_setzero_si512(), x0 = t->x0, x1 = t->x1;
    const __m512i s0 = _mm512_mask_sub_epi8(x0, w->neg0, zero, x0), s1 = _mm512_mask_sub_epi8(x1, w->neg1, zero, x1);
    return _mm512_cvtepi32_ps(_mm512_dpbusd_epi32(_mm512_dpbusd_epi32(zero, w->mag0, s0), w->mag1, s1));
}
MXI __m512 pair_add2(__m512 acc, const decoded2* w, const token2* t, __m512 e16) {
    return _mm512_fmadd_ps(pair_dot2(w, t), _mm512_mul_ps(t->xs, e16), acc);
}
#endif
#else
typedef struct { float v[8]; } lanes;
MXI lanes lanes_zero(void) { lanes a = {{0}}; return a; }
MXI lanes lanes_load(const float* p) { lanes a; memcpy(a.v, p, sizeof a.v); return a; }
MXI void lanes_store(float* p, lanes a) { memcpy(p, a.v, sizeof a.v); }
MXI float lanes_sum(lanes a) {
    float b[4];
    for (int l = 0; l < 4; l++) b[l] = a.v[l] + a.v[l + 4];
    return (b[0] + b[2]) + (b[1] + b[3]);
}
typedef struct { uint8_t p[64]; } decoded;  /* the 4-bit codes in the two registers' byte orders */

MXI decoded decode(const uint8_t* lo, const uint8_t* hi) {
    decoded r;
    for (int j = 0; j < 16; j++) {
        const uint8_t* src = j < 8 ? lo + 2 * j : hi + 2 * (j - 8);
        const unsigned h = src[0] | (unsigned)src[1] << 8;
        r.p[2 * j] = (h & 7) | ((h >> 6) & 8);                              /* C */
        r.p[2 * j + 1] = ((h >> 3) & 7) | ((h >> 9) & 8);                   /* B */
        r.p[32 + 2 * j] = ((h >> 6) & 7) | ((h >> 12) & 8);                 /* A */
        r.p[32 + 2 * j + 1] = ((h >> 10) & 1) | ((h >> 12) & 6) | ((h >> 8) & 8);  /* D */
    }
    return r;
}

MXI lanes make_e(float f0, float f1) { lanes e = {{f0, f0, f0, f0, f1, f1, f1, f1}}; return e; }

MXI lanes pair_add(lanes acc, const decoded* w, const int8_t* xp, const float* xs8, lanes e8) {
    for (int l = 0; l < 8; l++) {
        int s = 0;
        for (int i = 0; i < 4; i++)
            s += VALUES[w->p[4 * l + i]] * xp[4 * l + i] + VALUES[w->p[32 + 4 * l + i]] * xp[32 + 4 * l + i];
        acc.v[l] = fmaf((float)s, xs8[l] * e8.v[l], acc.v[l]);
    }
    return acc;
}
#endif

/* ---- rows ---------------------------------------------------------------------------------------------------- */

#if MX_PAIR2
/* P = 64 on VBMI: 8 rows' 256 contiguous bytes and 16 scale bytes at a time (one scale decode for 4 row pairs);
   one token: xs e8 formed for the 16 scale bytes at once, two panels per pass (a row pair's lanes loaded and
   stored once per two panels). The same products, sums and order as the loops of mx_tile. */
MXI __m512 xs_lanes(const token2* t) { return _mm512_permutexvar_ps(_mm512_set1_epi64(4ll << 32), t->xs); }

MXI void p64_pass1(const uint8_t* lo, const uint8_t* sc, size_t pstride, size_t sstride, const token2* k,
                   __m512 x0, __m512 x1, int two, int pf, float* c) {
    if (pf)
        for (int p = 2; p < 4; p++) {
            for (int j = 0; j < 4; j++) _mm_prefetch((const char*)(lo + 64 * j + p * pstride), MX_HINT);
            _mm_prefetch((const char*)(sc + p * sstride), MX_HINT);
        }
    const __m512 f0 = _mm512_mul_ps(e8_half_rows8(sc), x0);
    const __m512 f1 = two ? _mm512_mul_ps(e8_half_rows8(sc + sstride), x1) : f0;
    for (int j = 0; j < 4; j++) {  /* rows 2j, 2j + 1: 64 contiguous bytes */
        const decoded2 w0 = decode2(_mm512_loadu_si512(lo + 64 * j));
        __m512 v = _mm512_fmadd_ps(pair_dot2(&w0, &k[0]), e16_of(f0, j), _mm512_loadu_ps(c + 16 * j));
        if (two) {
            const decoded2 w1 = decode2(_mm512_loadu_si512(lo + pstride + 64 * j));
            v = _mm512_fmadd_ps(pair_dot2(&w1, &k[1]), e16_of(f1, j), v);
        }
        _mm512_storeu_ps(c + 16 * j, v);
    }
}

static void mx_p64(const mxmat* m, int n0, int nr, int nr8, int t0, int tt, const mxacts* a, float* acc) {
    const size_t pstride = (size_t)m->N * 32, sstride = (size_t)m->N * 2;
    const int nbp = a->nbp;
    for (int bp = 0; bp < nbp; bp += tt == 1 ? 2 : 1) {
        const uint8_t *prow = m->blocks + bp * pstride + (size_t)n0 * 32, *srow = m->scales + bp * sstride + n0 * 2;
        token2 tk[MX_TT];
        for (int i = 0; i < (tt == 1 ? 2 : tt) && bp + (tt == 1 ? i : 0) < nbp; i++) {
            const size_t tp = tt == 1 ? (size_t)t0 * nbp + bp + i : (size_t)(t0 + i) * nbp + bp;
            tk[i] = token_load2(a->q + tp * 64, a->s + tp * 8);
        }
        if (tt == 1) {
            const int two = bp + 1 < nbp, pf = bp + 2 < nbp;
            const __m512 x0 = xs_lanes(&tk[0]), x1 = two ? xs_lanes(&tk[1]) : x0;
            for (int r = 0; r < nr8; r += 8) {
                const uint8_t *lo = prow + (size_t)r * 32, *sc = srow + (size_t)r * 2;
                if (two) p64_pass1(lo, sc, pstride, sstride, tk, x0, x1, 1, pf, acc + 8 * r);
                else p64_pass1(lo, sc, pstride, sstride, tk, x0, x1, 0, pf, acc + 8 * r);
            }
            continue;
        }
        for (int r = 0; r < nr8; r += 8) {
            const uint8_t *lo = prow + (size_t)r * 32, *sc = srow + (size_t)r * 2;
            if (bp + MX_PF < nbp) {
                for (int j = 0; j < 4; j++) _mm_prefetch((const char*)(lo + 64 * j + MX_PF * pstride), MX_HINT);
                _mm_prefetch((const char*)(sc + MX_PF * sstride), MX_HINT);
            }
            const __m512 f = e8_half_rows8(sc);
            for (int j = 0; j < 4; j++) {
                const decoded2 w = decode2(_mm512_loadu_si512(lo + 64 * j));
                const __m512 e16 = e16_of(f, j);
                for (int i = 0; i < tt; i++) {
                    float* c = acc + 8 * (i * nr + r + 2 * j);
                    _mm512_storeu_ps(c, pair_add2(_mm512_loadu_ps(c), &w, &tk[i], e16));
                }
            }
        }
    }
}
#endif

/* Rows [n0, n1) ((n1 - n0) tt 8 <= MX_ACC) against tokens t0 .. t0 + tt - 1 (tt <= MX_TT): y[t * ldy + n]. Panel by
   panel, each row's and token's lanes accumulated in block order: a panel's rows are contiguous, so a tile reads one
   run of (n1 - n0) 32 bytes per panel, the panels N x 32 bytes apart. The runs' length sets the speed from DRAM:
   4 or 8 KB runs (128 or 256 rows) read at ~10 GB/s on one Zen 4 core where 16 KB runs read at ~17-20 and whole
   panels at ~23 (a plain load loop over the same bytes); the next panel's run is prefetched into L2 meanwhile. */
static void mx_tile(const mxmat* m, int n0, int n1, int t0, int tt, const mxacts* a, float* y, int ldy) {
    float acc[MX_ACC] __attribute__((aligned(64)));
    const int nb = m->K / 32, nr = n1 - n0;
    for (int i = 0; i < nr * tt; i++) lanes_store(acc + 8 * i, lanes_zero());
    static const uint8_t zeros[16];
    /* pair bp of row n: blocks 2bp, 2bp + 1 at lo, lo + hi_off (one 32-byte panel row for P = 64, two panels for
       P = 32), lo = blocks + bp N 32 + n 16 bpp; scales likewise (N 2 per pair, n bpp, + shi) */
    const size_t pstride = (size_t)m->N * 32, sstride = (size_t)m->N * 2;
    const size_t hi_off = m->bpp == 2 ? 16 : (size_t)m->N * 16, shi = m->bpp == 2 ? 1 : (size_t)m->N;
    int r0 = 0;  /* rows from r0 on: the loops below */
#if MX_PAIR2
    if (m->bpp == 2) mx_p64(m, n0, nr, r0 = nr & ~7, t0, tt, a, acc);
#endif
    for (int bp = 0; bp < a->nbp; bp++) {
        const int odd = 2 * bp + 1 >= nb, pf = bp + MX_PF < a->nbp;
        const uint8_t* prow = m->blocks + bp * pstride + (size_t)n0 * 16 * m->bpp;
        const uint8_t* srow = m->scales + bp * sstride + (size_t)n0 * m->bpp;
        int r = r0;
#if MX_PAIR2
        token2 tk[MX_TT];  /* the tile's tokens at this pair, loaded once (int8 loads may alias acc's stores) */
        for (int i = 0; i < tt; i++) {
            const size_t tp = (size_t)(t0 + i) * a->nbp + bp;
            tk[i] = token_load2(a->q + tp * 64, a->s + tp * 8);
        }
        for (; r + 1 < nr; r += 2) {  /* two rows per 512-bit register */
            const uint8_t *lo = prow + (size_t)r * 16 * m->bpp, *lo1 = lo + 16 * m->bpp;
            const uint8_t* sc = srow + (size_t)r * m->bpp;
            if (pf) {
                _mm_prefetch((const char*)(lo + MX_PF * pstride), MX_HINT);
                if (!(r & 31)) _mm_prefetch((const char*)(sc + MX_PF * sstride), MX_HINT);
            }
            const decoded2 w = decode2(load4x16(lo, odd ? zeros : lo + hi_off, lo1, odd ? zeros : lo1 + hi_off));
            uint32_t e4 = sc[0] | (uint32_t)sc[m->bpp] << 16;  /* bytes: row A's 2bp, 2bp + 1, row B's (0 if odd) */
            if (!odd) e4 |= (uint32_t)sc[shi] << 8 | (uint32_t)sc[m->bpp + shi] << 24;
            const __m512 e16 = e8_half16(e4, odd);
            for (int i = 0; i < tt; i++) {
                float* c = acc + 8 * (i * nr + r);
                _mm512_storeu_ps(c, pair_add2(_mm512_loadu_ps(c), &w, &tk[i], e16));
            }
        }
#endif
        for (; r < nr; r++) {
            const uint8_t* lo = prow + (size_t)r * 16 * m->bpp;
            const uint8_t* sc = srow + (size_t)r * m->bpp;
#if MF_AVX2
            if (pf) _mm_prefetch((const char*)(lo + MX_PF * pstride), MX_HINT);
#endif
            const decoded w = decode(lo, odd ? zeros : lo + hi_off);
            const float f0 = e8_half(sc[0]), f1 = odd ? 0.0f : e8_half(sc[shi]);
            const lanes e8 = make_e(f0, f1);
            for (int i = 0; i < tt; i++) {
                const size_t tp = (size_t)(t0 + i) * a->nbp + bp;
                float* c = acc + 8 * (i * nr + r);
                lanes_store(c, pair_add(lanes_load(c), &w, a->q + tp * 64, a->s + tp * 8, e8));
            }
        }
    }
    for (int r = 0; r < nr; r++)
        for (int i = 0; i < tt; i++) y[(size_t)(t0 + i) * ldy + n0 + r] = lanes_sum(lanes_load(acc + 8 * (i * nr + r)));
}

/* Rows [n0, n1) on T tokens: tiles of as many rows as MX_ACC holds for MX_TT tokens (T >= 4: 512 rows, 16 KB runs;
   T = 1: 2048), each computed for every tile of tokens while its blocks are in L2. */
static void mx_rows(const mxmat* m, int n0, int n1, int T, const mxacts* a, float* y, int ldy) {
    const int tt = T < MX_TT ? T : MX_TT, cap = MX_ACC / (8 * tt), nt = (n1 - n0 + cap - 1) / cap;
    const int rows = ((n1 - n0 + nt - 1) / nt + 7) & ~7;  /* tiles of equal rows, a multiple of 8 */
    for (int s = n0; s < n1; s += rows)
        for (int t0 = 0; t0 < T; t0 += MX_TT)
            mx_tile(m, s, s + rows < n1 ? s + rows : n1, t0, T - t0 < MX_TT ? T - t0 : MX_TT, a, y, ldy);
}

/* Rows per work item for N rows on nthreads: an equal share per thread (a multiple of 16, at least 32), so that
   each thread reads long runs of each panel (see mx_tile). The numbers do not depend on it (each row's operations
   are its own). */
static int mx_chunk(int N, int nthreads) {
    const int n = nthreads > 0 ? nthreads : 1, c = ((N + n - 1) / n + 15) & ~15;
    return c < 32 ? 32 : c;
}

static int mx_check(int K, int panel, const uint8_t* b, const uint8_t* s) {
    return !b || !s || K <= 0 || K % 32 || (panel != 32 && panel != 64) || K % panel ? -2 : 0;
}

/* y fp32 [T, N] = x fp32 [T, K] @ W.T, W [N, K] in the region layout (blocks, scales; panels of `panel` inputs).
   Returns 0, -1 out of memory, -2 bad arguments (K not a multiple of 32 and of the panel, panel not 32 or 64). */
int mf_mxfp4_linear(const float* x, int T, int K, int N, const uint8_t* blocks, const uint8_t* scales, int panel,
                    float* y, int nthreads) {
    if (mx_check(K, panel, blocks, scales)) return -2;
    const mxmat m = {blocks, scales, N, K, panel / 32};
    mxacts a;
    if (mx_acts_alloc(&a, T, K)) { mx_acts_free(&a); return -1; }
    for (int t = 0; t < T; t++) mx_acts_row(&a, x + (size_t)t * K, K, t);
    const int ch = mx_chunk(N, nthreads), nc = (N + ch - 1) / ch;
#pragma omp parallel for num_threads(nthreads) schedule(static)
    for (int c = 0; c < nc; c++) mx_rows(&m, c * ch, (c + 1) * ch < N ? (c + 1) * ch : N, T, &a, y, N);
    mx_acts_free(&a);
    return 0;
}


/* One gpt-oss expert on T tokens, its matrices as the region stores them: w13 [2I, H] (gate rows, then up) in
   panels of p13, w2 [H, I] in panels of p2; bias13 [2I], bias2 [H] of `bias_kind` (NULL: none); x fp32 [T, H],
   weight fp32 [T], out fp32 [T, H]: out[t] (+)= weight[t] * (act(x w13.T + bias13) w2.T + bias2). act MX_SILU or
   MX_SWIGLU (alpha, limit). Returns as mf_mxfp4_linear. */
int mf_mxfp4_expert(const float* x, int T, int H, int I, const uint8_t* b13, const uint8_t* s13, int p13,
                    const void* bias13, const uint8_t* b2, const uint8_t* s2, int p2, const void* bias2,
                    int bias_kind, int act, float alpha, float limit, const float* weight, float* out,
                    int accumulate, int nthreads) {
    if (mx_check(H, p13, b13, s13) || mx_check(I, p2, b2, s2) || (act != MX_SILU && act != MX_SWIGLU)
        || bias_kind < 0 || bias_kind > MX_BIAS_F16)
        return -2;
    const mxmat w13 = {b13, s13, 2 * I, H, p13 / 32}, w2 = {b2, s2, H, I, p2 / 32};
    mxacts ax, aa;
    float* f = malloc(sizeof(float) * ((size_t)T * 3 * I + (size_t)T * H));
    const int bad = mx_acts_alloc(&ax, T, H) | mx_acts_alloc(&aa, T, I);
    if (bad || !f) { mx_acts_free(&ax); mx_acts_free(&aa); free(f); return -1; }
    float *h = f, *av = h + (size_t)T * 2 * I, *y = av + (size_t)T * I;
    for (int t = 0; t < T; t++) mx_acts_row(&ax, x + (size_t)t * H, H, t);
    const int ch13 = mx_chunk(2 * I, nthreads), ch2 = mx_chunk(H, nthreads);
    const int nc13 = (2 * I + ch13 - 1) / ch13, nc2 = (H + ch2 - 1) / ch2;
#pragma omp parallel num_threads(nthreads)
    {
#pragma omp for schedule(static)
        for (int c = 0; c < nc13; c++)
            mx_rows(&w13, c * ch13, (c + 1) * ch13 < 2 * I ? (c + 1) * ch13 : 2 * I, T, &ax, h, 2 * I);
#pragma omp for schedule(static)
        for (int t = 0; t < T; t++) {
            const float* ht = h + (size_t)t * 2 * I;
            float* at = av + (size_t)t * I;
            mx_gate_up(ht, at, I, bias13, bias_kind, act, alpha, limit);
            mx_acts_row(&aa, at, I, t);
        }
#pragma omp for schedule(static)
        for (int c = 0; c < nc2; c++) {
            const int n0 = c * ch2, n1 = n0 + ch2 < H ? n0 + ch2 : H;
            mx_rows(&w2, n0, n1, T, &aa, y, H);
            mx_down_out(y, T, H, n0, n1, bias2, bias_kind, weight, out, accumulate);
        }
    }
    mx_acts_free(&ax); mx_acts_free(&aa); free(f);
    return 0;
}
