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
   on one Zen 4 core). The block-pair primitives of each build are in mxfp4_pair.h.

   The order rows are read in (s17): a panel's rows are contiguous (32 bytes per row and pair for P = 64), the
   panels N x 32 bytes apart. A work item (a thread's share of the rows, mx_chunk) is cut into tiles of as many rows
   as 64 KB of fp32 lanes hold (one token: 2048 rows; four: 512), each computed panel by panel, i.e. one run of
   rows x 32 bytes per panel, the next panels' runs prefetched into L2 meanwhile. A plain load loop in that order
   (benchmarks/cpu/mxfp4_read_order.py, one Zen 4 core, from DRAM) reads runs of 4 or 8 KB at ~10.5 GB/s, 16-64 KB
   runs at ~17.5 and front to back at ~21; with the L2 prefetch 4 KB runs at 16.5, 16-64 KB at 20.5-21. With P = 64
   on VBMI 8 rows' 256 bytes and 16 scale bytes go at once (one load per row pair, one e8m0 decode per 4 pairs), one
   token two panels per pass (its lanes loaded and stored once per two). One gpt-oss-120b expert at one token, from
   C: 0.9 -> 0.6 ms from the L3 cache, 1.2 -> ~0.7 ms from DRAM (~19 GB/s of its 13.2 MB; the former items of 128
   rows with the L1 prefetch 4 panels on read at ~10.5; 128-row tiles with this L2 prefetch ~17), the same bits.

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
#include "mxfp4_pair.h"

#define MX_ACC 16384  /* fp32 accumulators of a tile (64 KB): rows x tokens x 8 lanes (32 K: no faster) */
#define MX_TT 4       /* tokens per tile: a block pair is decoded once per row and tile */
#define MX_PF 1       /* mx_tile's loops prefetch the blocks (and scales) a panel on; mx_p64 two or three */
#define MX_HINT _MM_HINT_T1  /* into L2: into L1 (T0) ran at ~11 GB/s where L2 ran at ~16 (T = 1, from DRAM) */

typedef struct {  /* one matrix W [N, K] in the region layout */
    const uint8_t* blocks;
    const uint8_t* scales;
    int N, K, bpp;  /* bpp: blocks per panel (P / 32) */
} mxmat;


/* ---- rows ---------------------------------------------------------------------------------------------------- */

#if MX_PAIR2
/* P = 64 on VBMI: 8 rows' 256 contiguous bytes and 16 scale bytes at a time (one scale decode for 4 row pairs), two
   panels per pass (a row pair's lanes loaded and stored once per two panels); one token: xs e8 formed for the 16
   scale bytes at once. The same products, sums and order as the loops of mx_tile. */
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

/* tt tokens (k[p][i]: token i at panel p of the pass), their lanes at c + 8 i nr: pair_add2 per panel */
MXI void p64_passn(const uint8_t* lo, const uint8_t* sc, size_t pstride, size_t sstride, token2 (*k)[MX_TT],
                   int tt, int two, int pf, float* c, int nr) {
    if (pf)
        for (int p = 2; p < 4; p++) {
            for (int j = 0; j < 4; j++) _mm_prefetch((const char*)(lo + 64 * j + p * pstride), MX_HINT);
            _mm_prefetch((const char*)(sc + p * sstride), MX_HINT);
        }
    const __m512 f0 = e8_half_rows8(sc), f1 = two ? e8_half_rows8(sc + sstride) : f0;
    for (int j = 0; j < 4; j++) {
        const decoded2 w0 = decode2(_mm512_loadu_si512(lo + 64 * j));
        const decoded2 w1 = two ? decode2(_mm512_loadu_si512(lo + pstride + 64 * j)) : w0;
        const __m512 e0 = e16_of(f0, j), e1 = e16_of(f1, j);
        for (int i = 0; i < tt; i++) {
            float* ci = c + (size_t)8 * i * nr + 16 * j;
            __m512 v = pair_add2(_mm512_loadu_ps(ci), &w0, &k[0][i], e0);
            if (two) v = pair_add2(v, &w1, &k[1][i], e1);
            _mm512_storeu_ps(ci, v);
        }
    }
}

static void mx_p64(const mxmat* m, int n0, int nr, int nr8, int t0, int tt, const mxacts* a, float* acc) {
    const size_t pstride = (size_t)m->N * 32, sstride = (size_t)m->N * 2;
    const int nbp = a->nbp;
    for (int bp = 0; bp < nbp; bp += 2) {  /* two panels per pass */
        const uint8_t *prow = m->blocks + bp * pstride + (size_t)n0 * 32, *srow = m->scales + bp * sstride + n0 * 2;
        const int two = bp + 1 < nbp, pf = bp + 2 < nbp;
        token2 tk[2][MX_TT];
        for (int p = 0; p < 1 + two; p++)
            for (int i = 0; i < tt; i++) {
                const size_t tp = (size_t)(t0 + i) * nbp + bp + p;
                tk[p][i] = token_load2(a->q + tp * 64, a->s + tp * 8);
            }
        if (tt == 1) {
            const __m512 x0 = xs_lanes(&tk[0][0]), x1 = two ? xs_lanes(&tk[1][0]) : x0;
            const token2 k1[2] = {tk[0][0], two ? tk[1][0] : tk[0][0]};
            for (int r = 0; r < nr8; r += 8) {
                const uint8_t *lo = prow + (size_t)r * 32, *sc = srow + (size_t)r * 2;
                if (two) p64_pass1(lo, sc, pstride, sstride, k1, x0, x1, 1, pf, acc + 8 * r);
                else p64_pass1(lo, sc, pstride, sstride, k1, x0, x1, 0, pf, acc + 8 * r);
            }
            continue;
        }
        for (int r = 0; r < nr8; r += 8) {
            const uint8_t *lo = prow + (size_t)r * 32, *sc = srow + (size_t)r * 2;
            if (two) p64_passn(lo, sc, pstride, sstride, tk, tt, 1, pf, acc + 8 * r, nr);
            else p64_passn(lo, sc, pstride, sstride, tk, tt, 0, pf, acc + 8 * r, nr);
        }
    }
}
#endif

#if MF_AVX2 && !MX_PAIR2
/* P = 64 on AVX2 (and AVX-512 without VBMI): 4 rows' 128 contiguous bytes and 8 scale bytes at a time, one 32-byte
   load per row and one e8m0 decode per 4 rows; the same operations and order as mx_tile's loops. */
static void mx_p64(const mxmat* m, int n0, int nr, int nr4, int t0, int tt, const mxacts* a, float* acc) {
    const size_t pstride = (size_t)m->N * 32, sstride = (size_t)m->N * 2;
    for (int bp = 0; bp < a->nbp; bp++) {
        const uint8_t *prow = m->blocks + bp * pstride + (size_t)n0 * 32, *srow = m->scales + bp * sstride + n0 * 2;
        const int pf = bp + MX_PF < a->nbp;
        for (int r = 0; r < nr4; r += 4) {
            const uint8_t *lo = prow + (size_t)r * 32, *sc = srow + (size_t)r * 2;
            if (pf) {
                _mm_prefetch((const char*)(lo + MX_PF * pstride), MX_HINT);
                _mm_prefetch((const char*)(lo + 64 + MX_PF * pstride), MX_HINT);
                if (!(r & 31)) _mm_prefetch((const char*)(sc + MX_PF * sstride), MX_HINT);
            }
            const __m256 f = e8_half_rows4(sc);
            for (int q = 0; q < 4; q++) {
                const decoded w = decode_w(_mm256_loadu_si256((const __m256i*)(lo + 32 * q)));
                const lanes e8 = e8_of(f, q);
                for (int i = 0; i < tt; i++) {
                    const size_t tp = (size_t)(t0 + i) * a->nbp + bp;
                    float* c = acc + 8 * (i * nr + r + q);
                    lanes_store(c, pair_add(lanes_load(c), &w, a->q + tp * 64, a->s + tp * 8, e8));
                }
            }
        }
    }
}
#endif

/* Rows [n0, n1) ((n1 - n0) tt 8 <= MX_ACC) against tokens t0 .. t0 + tt - 1 (tt <= MX_TT): y[t * ldy + n]. Panel by
   panel (one run of (n1 - n0) 32 bytes each, see the top), each row's and token's lanes accumulated in block order;
   P = 64 on VBMI in mx_p64 but for the last (n1 - n0) mod 8 rows. */
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
#elif MF_AVX2
    if (m->bpp == 2) mx_p64(m, n0, nr, r0 = nr & ~3, t0, tt, a, acc);
#endif
    for (int bp = 0; r0 < nr && bp < a->nbp; bp++) {
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
    if (n1 <= n0 || T <= 0) return;
    const int tt = T < MX_TT ? T : MX_TT, cap = MX_ACC / (8 * tt), nt = (n1 - n0 + cap - 1) / cap;
    const int rows = ((n1 - n0 + nt - 1) / nt + 7) & ~7;  /* tiles of equal rows, a multiple of 8 */
    for (int s = n0; s < n1; s += rows)
        for (int t0 = 0; t0 < T; t0 += MX_TT)
            mx_tile(m, s, s + rows < n1 ? s + rows : n1, t0, T - t0 < MX_TT ? T - t0 : MX_TT, a, y, ldy);
}

/* Rows per work item for N rows on nthreads: an equal share per thread (a multiple of 16, at least 32), so that
   each thread reads long runs of each panel (see the comment at the top). The numbers do not depend on it (each row's operations
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

/* ---- one token's rows inside an enclosing team (step_gptoss.c: gpt-oss's experts in the one-call decode step) -- */

/* Rows [n0, n1) of W [N, K] in the region layout (blocks, scales; panels of `panel` inputs) against token 0 of a:
   y[n] for n in [n0, n1), tiled by mx_rows: mf_mxfp4_linear's and mf_mxfp4_expert's numbers bit for bit
   (each row's operations are its own, whatever the pieces). Called by any thread on its own rows. */
void mf_mxfp4_rows1(const uint8_t* blocks, const uint8_t* scales, int N, int K, int panel, int n0, int n1,
                    const mxacts* a, float* y) {
    const mxmat m = {blocks, scales, N, K, panel / 32};
    mx_rows(&m, n0, n1, 1, a, y, N);  /* it tiles long ranges itself: give it a thread's whole share */
}
