/* GGUF experts on the CPU (issue 39): an expert's gate, up and down matrices read as the file stores them (ggml
   blocks, rows one after the other: the bytes the host store, the disk tier and the slots hold) times int8
   activations. Types: Q4_0, Q8_0, Q4_K, Q5_K, Q6_K (block layouts: moeflow/kernels/experts/gguf_reference.py), and
   Q4_K rows repacked 8 at a time at load (GG_Q4_KX8, gguf_q4kx8.c: Q4_K's numbers bit for bit).
   Binding and fp32 model: moeflow/kernels/cpu/gguf.py.

   Activations (as llama.cpp pairs them): for Q4_0 and Q8_0 weights, blocks of 32 (its Q8_0 activations), for the
   K-quants blocks of 256 (its Q8_K) with the sums of each 16 codes; one fp32 scale per block, xs = max|x| / 127,
   xq = round-half-even(x * (127 / max|x|)) in [-127, 127] (the rounding of native.c's activations).

   Numerics, per output row and token, the same operations whatever the ISA (AVX-512 VNNI, AVX2, portable C) and
   the batch, so the builds give the same bits and a token's outputs never depend on the other tokens:
     Q4_0 (value q - 8), Q8_0: per block 8 exact int32 lanes (lane l: codes 4l .. 4l + 3), each added to its fp32
       lane by a fused multiply-add with d * xs, the 8 lanes summed once per row in a fixed order (gguf.h's facc);
     K-quants: per block 8 exact int32 lanes (gguf_k.c's kdot: lane l holds the codes 32 i + 4 l + c, c < 4, each
       times its scale, and the mins' or offsets' share of two 16-groups), then 8 fp32 lanes accumulated across
       blocks by fused multiply-adds, summed once per row in a fixed order:
       Q5_K (q in [0, 31], 6-bit sc and m per 32 codes): lane += isum_l (d xs), lane += imin_l (-dmin xs),
         isum = sum sc[s] q xq, imin = sum m[s] * (sum of 16 codes);
       Q4_K (since session 19, so that the 8-row interleaved form gives the same bits): the 8 lanes summed into one
         exact int32 per block, isum and imin, then A = fma(isum, d xs, A), B = fma(imin, dmin xs, B) across blocks
         and the row's y = A - B;
       Q6_K (q in [0, 63] stored, value q - 32, int8 sc per 16): lane += (isum_l - imin_l) (d xs),
         imin = sum 32 sc[g] * (sum of 16 codes).

   How: a K-quant block is decoded once per row, block and tile of tokens into its 256 unsigned codes and its
   scales widened to int16 lanes, held in registers, then each token's sums are maddubs (unsigned codes x
   signed activations, pairs summed into int16: at most 2 * 63 * 127, no saturation) and a multiply-add with the
   scales (vpdpwssd on AVX-512 VNNI, pmaddwd on AVX2); on AVX-512 VNNI, Q4_K / Q5_K instead take vpdpbusd per
   32-code sub-block and vpdpwssd with its scale (gguf_k.c's k4block: the same lanes; Q4_K and Q6_K two sums as one
   word pair per vpdpwssd, gguf_k.c's q4kblock and k6block). Q4_K / Q5_K weights are
   prefetched MF_Q4_PREFETCH bytes ahead. Q8_0 uses the sign trick of q8.c (|w| x sign(x, w)). */

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "gguf.h"

void mf_silu_mul(const float* g, const float* u, int n, float* out); /* native.c */

/* ---- activations -------------------------------------------------------------------------------------------- */

/* max |x| over n (a multiple of 8) floats: fmaxf's result (a NaN is skipped, as fmaxf skips it); exact, so the
   order of the comparisons does not matter. */
static inline float absmax(const float* x, int n) {
#if MF_AVX2
    const __m256 sign = _mm256_set1_ps(-0.0f);
    __m256 m = _mm256_setzero_ps();
    for (int i = 0; i < n; i += 8) m = _mm256_max_ps(_mm256_andnot_ps(sign, _mm256_loadu_ps(x + i)), m);  /* NaN: m */
    float v[8], r = 0.0f;
    _mm256_storeu_ps(v, m);
    for (int l = 0; l < 8; l++) r = v[l] > r ? v[l] : r;
    return r;
#else
    float r = 0.0f;
    for (int i = 0; i < n; i++) r = fmaxf(r, fabsf(x[i]));
    return r;
#endif
}

/* x fp32 [K] -> xq int8 [K], xs fp32 [K / bs], bsum int16 [K / 16] (sums of 16 codes; NULL: not wanted): the same
   numbers on every build (rounding half to even, as nearbyintf in the default mode). */
static void quantize_row(const float* x, int K, int bs, int8_t* xq, float* xs, int16_t* bsum) {
    for (int b = 0; b < K / bs; b++) {
        const float* xb = x + (size_t)b * bs;
        const float amax = absmax(xb, bs);
        const float inv = amax > 0.0f ? 127.0f / amax : 0.0f;
        for (int i = 0; i < bs; i++) xq[(size_t)b * bs + i] = (int8_t)(int)nearbyintf(xb[i] * inv);
        xs[b] = amax / 127.0f;
    }
    if (bsum)
        for (int g = 0; g < K / 16; g++) {
            int s = 0;
            for (int i = 0; i < 16; i++) s += xq[(size_t)g * 16 + i];
            bsum[g] = (int16_t)s;
        }
}

static int acts_alloc(acts* a, int T, int K, int type) {
    a->K = K;
    a->bs = type_block(type);
    a->q = malloc((size_t)T * K);
    a->s = malloc(sizeof(float) * (size_t)T * (K / a->bs));
    a->sum = malloc(sizeof(int16_t) * (size_t)T * (K / 16));
    a->type = type;
    a->z8 = type == GG_Q4_0 ? malloc(sizeof(int32_t) * (size_t)T * (K / 4)) : NULL;
    return a->q && a->s && a->sum && (a->z8 || type != GG_Q4_0) ? 0 : -1;
}
static void acts_free(acts* a) { free(a->q); free(a->s); free(a->sum); free(a->z8); }
static void acts_row(acts* a, const float* x, int t) {
    int8_t* q = a->q + (size_t)t * a->K;
    quantize_row(x, a->K, a->bs, q, a->s + (size_t)t * (a->K / a->bs),
                 a->bs == QKK ? a->sum + (size_t)t * (a->K / 16) : NULL);
    if (a->type == GG_Q4_0)
        for (int l = 0; l < a->K / 4; l++)
            a->z8[(size_t)t * (a->K / 4) + l] = -8 * (q[4 * l] + q[4 * l + 1] + q[4 * l + 2] + q[4 * l + 3]);
}

/* ---- Q8_0 ------------------------------------------------------------------------------------------------------ */

/* A Q8_0 block (34 bytes) against 32 activation codes into a token's lanes: lane l += (sum over codes 4l .. 4l + 3
   of q xq) * dx, one fused multiply-add (dpbusd's and pmaddwd's lanes; |w| x sign(x, w), exact). */
INLINE facc q8_0_add(facc acc, const uint8_t* w, const int8_t* x, float dx) {
#if MF_AVX2
    const __m256i wq = _mm256_loadu_si256((const __m256i*)(w + 2)), xq = _mm256_loadu_si256((const __m256i*)x);
#if MF_AVX512
    const __m256i v = _mm256_dpbusd_epi32(_mm256_setzero_si256(), _mm256_sign_epi8(wq, wq), _mm256_sign_epi8(xq, wq));
#else
    const __m256i v = _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_sign_epi8(wq, wq), _mm256_sign_epi8(xq, wq)),
                                        _mm256_set1_epi16(1));
#endif
    return _mm256_fmadd_ps(_mm256_cvtepi32_ps(v), _mm256_set1_ps(dx), acc);
#else
    for (int l = 0; l < 8; l++) {
        int s = 0;
        for (int c = 0; c < 4; c++) s += (int8_t)w[2 + 4 * l + c] * x[4 * l + c];
        acc.v[l] = fmaf((float)s, dx, acc.v[l]);
    }
    return acc;
#endif
}

/* Row `row` (nb Q8_0 blocks) against the tokens t0 .. t0 + tt (a constant after inlining): y[t * ldy]. */
INLINE void q8_0_tile(const uint8_t* row, int nb, int t0, int tt, const acts* a, float* y, int ldy) {
    const int K = a->K;
    facc acc[GTT];
    for (int i = 0; i < tt; i++) acc[i] = facc_zero();
    for (int b = 0; b < nb; b++) {
        const uint8_t* w = row + (size_t)b * 34;
        const float d = h2f(w);
        for (int i = 0; i < tt; i++) {
            const int t = t0 + i;
            acc[i] = q8_0_add(acc[i], w, a->q + (size_t)t * K + (size_t)b * 32, d * a->s[(size_t)t * (K / 32) + b]);
        }
    }
    for (int i = 0; i < tt; i++) y[(size_t)(t0 + i) * ldy] = facc_sum(acc[i]);
}

static void q8_0_row(const uint8_t* row, int nb, int T, const acts* a, float* y, int ldy) {
    int t0 = 0;
    for (; t0 + GTT <= T; t0 += GTT) q8_0_tile(row, nb, t0, GTT, a, y, ldy);
    if (T - t0 >= 4) { q8_0_tile(row, nb, t0, 4, a, y, ldy); t0 += 4; }
    if (T - t0 >= 2) { q8_0_tile(row, nb, t0, 2, a, y, ldy); t0 += 2; }
    if (T - t0 >= 1) q8_0_tile(row, nb, t0, 1, a, y, ldy);
}

/* ---- Q4_0 ------------------------------------------------------------------------------------------------------ */

/* A Q4_0 block (18 bytes: fp16 d, 16 bytes of nibbles; code j < 16 the low nibble of byte j, code 16 + j its high
   nibble, value q - 8) against 32 activation codes into a token's lanes, as Q8_0: lane l += (sum over codes
   4l .. 4l + 3 of (q - 8) xq) * dx, one fused multiply-add. The lane's integer is formed as z8_l + sum q xq
   (z8_l = -8 x the lane's activation sum, acts_row's; unsigned codes x signed activations, exact), the block
   decoded to its 32 codes once per tile of tokens. */
#if MF_AVX2
INLINE __m256i q4_0_codes(const uint8_t* w) {
    const __m128i raw = _mm_loadu_si128((const __m128i*)(w + 2));
    return _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(raw, 4), raw), _mm256_set1_epi8(15));
}
INLINE facc q4_0_add(facc acc, __m256i wq, const int8_t* x, const int32_t* z8, float dx) {
    const __m256i xq = _mm256_loadu_si256((const __m256i*)x), z = _mm256_loadu_si256((const __m256i*)z8);
#if MF_AVX512
    const __m256i v = _mm256_dpbusd_epi32(z, wq, xq);
#else
    const __m256i v = _mm256_add_epi32(z, _mm256_madd_epi16(_mm256_maddubs_epi16(wq, xq), _mm256_set1_epi16(1)));
#endif
    return _mm256_fmadd_ps(_mm256_cvtepi32_ps(v), _mm256_set1_ps(dx), acc);
}
#else
INLINE facc q4_0_add(facc acc, const uint8_t* w, const int8_t* x, const int32_t* z8, float dx) {
    for (int l = 0; l < 8; l++) {
        int s = z8[l];
        for (int c = 0; c < 4; c++) {
            const int j = 4 * l + c, q = j < 16 ? (w[2 + j] & 15) : (w[2 + j - 16] >> 4);
            s += q * x[j];
        }
        acc.v[l] = fmaf((float)s, dx, acc.v[l]);
    }
    return acc;
}
#endif

/* Row `row` (nb Q4_0 blocks) against the tokens t0 .. t0 + tt (a constant after inlining): y[t * ldy]. */
INLINE void q4_0_tile(const uint8_t* row, int nb, int t0, int tt, const acts* a, float* y, int ldy) {
    const int K = a->K;
    facc acc[GTT];
    for (int i = 0; i < tt; i++) acc[i] = facc_zero();
    for (int b = 0; b < nb; b++) {
        const uint8_t* w = row + (size_t)b * 18;
        const float d = h2f(w);
#if MF_AVX2
        const __m256i wq = q4_0_codes(w);
#else
        const uint8_t* wq = w;
#endif
        for (int i = 0; i < tt; i++) {
            const int t = t0 + i;
            acc[i] = q4_0_add(acc[i], wq, a->q + (size_t)t * K + (size_t)b * 32, a->z8 + (size_t)t * (K / 4) + 8 * b,
                              d * a->s[(size_t)t * (K / 32) + b]);
        }
    }
    for (int i = 0; i < tt; i++) y[(size_t)(t0 + i) * ldy] = facc_sum(acc[i]);
}

static void q4_0_row(const uint8_t* row, int nb, int T, const acts* a, float* y, int ldy) {
    int t0 = 0;
    for (; t0 + GTT <= T; t0 += GTT) q4_0_tile(row, nb, t0, GTT, a, y, ldy);
    if (T - t0 >= 4) { q4_0_tile(row, nb, t0, 4, a, y, ldy); t0 += 4; }
    if (T - t0 >= 2) { q4_0_tile(row, nb, t0, 2, a, y, ldy); t0 += 2; }
    if (T - t0 >= 1) q4_0_tile(row, nb, t0, 1, a, y, ldy);
}

/* ---- rows, linear, expert ---------------------------------------------------------------------------------- */

static void rows(int type, const uint8_t* w, int64_t stride, int n0, int n1, int T, const acts* a, float* y,
                 int ldy) {
    const int nb = a->K / type_block(type);
    if (type == GG_Q4_KX8) {  /* Q4_K rows interleaved by 8 (gguf_q4kx8.c; n0, n1 multiples of 8: GROWS is) */
        mf_gguf_x8rows(w, stride, n0, n1, nb, T, a, y, ldy);
        return;
    }
    if (type != GG_Q8_0 && type != GG_Q4_0) {  /* the K-quants: gguf_k.c's row loop */
        mf_gguf_krows(type, w, stride, n0, n1, nb, T, a, y, ldy);
        return;
    }
    for (int n = n0; n < n1; n++) {
        const uint8_t* r = w + (size_t)n * stride;
        if (type == GG_Q8_0) q8_0_row(r, nb, T, a, y + n, ldy);
        else q4_0_row(r, nb, T, a, y + n, ldy);
    }
}

static int check(int type, int K) { return type_bytes(type) && K % type_block(type) == 0 ? 0 : -2; }
/* check() for a matrix of N rows (GG_Q4_KX8: rows in groups of 8) */
static int check_rows(int type, int K, int N) { return check(type, K) || (type == GG_Q4_KX8 && N % 8) ? -2 : 0; }

/* y fp32 [T, N] = x fp32 [T, K] @ W.T for W [N, K] of ggml type `type` (rows `stride` bytes apart).
   Returns 0, -1 out of memory, -2 an unsupported type or K not a multiple of its block. */
int mf_gguf_linear(const float* x, int T, int K, int N, int type, const uint8_t* w, int64_t stride, float* y,
                   int nthreads) {
    if (check_rows(type, K, N)) return -2;
    acts a;
    if (acts_alloc(&a, T, K, type)) { acts_free(&a); return -1; }
    for (int t = 0; t < T; t++) acts_row(&a, x + (size_t)t * K, t);
    const int nc = (N + GROWS - 1) / GROWS;
#pragma omp parallel for num_threads(nthreads) schedule(static)
    for (int c = 0; c < nc; c++) rows(type, w, stride, c * GROWS, (c + 1) * GROWS < N ? (c + 1) * GROWS : N, T, &a, y, N);
    acts_free(&a);
    return 0;
}

/* One SwiGLU expert on T tokens, its matrices as the GGUF file stores them: gate and up [I, H] of type t13 (rows
   s13 bytes apart), down [H, I] of type t2 (rows s2 bytes apart); x fp32 [T, H], weight fp32 [T], out fp32 [T, H]:
   out[t] (+)= weight[t] * (silu(x gate.T) * (x up.T)) down.T. Returns as mf_gguf_linear. */
int mf_gguf_expert(const float* x, int T, int H, int I, int t13, const uint8_t* gate, const uint8_t* up,
                   int64_t s13, int t2, const uint8_t* down, int64_t s2, const float* weight, float* out,
                   int accumulate, int nthreads) {
    if (check_rows(t13, H, I) || check_rows(t2, I, H)) return -2;
    acts ax, aa;
    float* f = malloc(sizeof(float) * ((size_t)T * 3 * I + (size_t)T * H));
    int bad = acts_alloc(&ax, T, H, t13) | acts_alloc(&aa, T, I, t2);
    if (bad || !f) { acts_free(&ax); acts_free(&aa); free(f); return -1; }
    float *hg = f, *hu = hg + (size_t)T * I, *act = hu + (size_t)T * I, *y = act + (size_t)T * I;
    for (int t = 0; t < T; t++) acts_row(&ax, x + (size_t)t * H, t);
    const int nc13 = (I + GROWS - 1) / GROWS, nc2 = (H + GROWS - 1) / GROWS;
#pragma omp parallel num_threads(nthreads)
    {
#pragma omp for schedule(static)
        for (int c = 0; c < nc13; c++) {
            const int n0 = c * GROWS, n1 = n0 + GROWS < I ? n0 + GROWS : I;
            rows(t13, gate, s13, n0, n1, T, &ax, hg, I);
            rows(t13, up, s13, n0, n1, T, &ax, hu, I);
        }
#pragma omp for schedule(static)
        for (int t = 0; t < T; t++) {
            mf_silu_mul(hg + (size_t)t * I, hu + (size_t)t * I, I, act + (size_t)t * I);
            acts_row(&aa, act + (size_t)t * I, t);
        }
#pragma omp for schedule(static)
        for (int c = 0; c < nc2; c++) {
            const int n0 = c * GROWS, n1 = n0 + GROWS < H ? n0 + GROWS : H;
            rows(t2, down, s2, n0, n1, T, &aa, y, H);
            for (int t = 0; t < T; t++)
                for (int n = n0; n < n1; n++) {
                    const float v = weight[t] * y[(size_t)t * H + n];
                    out[(size_t)t * H + n] = accumulate ? out[(size_t)t * H + n] + v : v;
                }
        }
    }
    acts_free(&ax); acts_free(&aa); free(f);
    return 0;
}

/* ---- the one-token expert inside an enclosing parallel region (step_region.c) ---------------------------------- */

/* 0 when mf_gguf_expert takes these types and sizes, else -2 (its refusal). */
int mf_gguf_supported(int t13, int H, int t2, int I) { return check_rows(t13, H, I) || check_rows(t2, I, H) ? -2 : 0; }

static size_t up64g(size_t n) { return (n + 63) & ~(size_t)63; }
static size_t acts1_bytes(int K) {  /* one token's acts of any type (blocks of 32 at the least) */
    return up64g((size_t)K) + up64g(sizeof(float) * (size_t)(K / 32)) + up64g(sizeof(int16_t) * (size_t)(K / 16)) +
           up64g(sizeof(int32_t) * (size_t)(K / 4));
}
static void acts1_carve(acts* a, char** p, int K, int type) {
    a->K = K;
    a->bs = type_block(type);
    a->type = type;
    a->q = (int8_t*)*p; *p += up64g((size_t)K);
    a->s = (float*)*p; *p += up64g(sizeof(float) * (size_t)(K / 32));
    a->sum = (int16_t*)*p; *p += up64g(sizeof(int16_t) * (size_t)(K / 16));
    a->z8 = (int32_t*)*p; *p += up64g(sizeof(int32_t) * (size_t)(K / 4));
}

/* The bytes of one thread's scratch for mf_gguf_expert_team (64-byte aligned pieces). */
size_t mf_gguf_team_bytes(int H, int I) { return acts1_bytes(H) + acts1_bytes(I) + up64g(sizeof(float) * (size_t)I); }

/* mf_gguf_expert at T = 1 (its numbers bit for bit), called by every thread of an enclosing team: the gate/up and
   down rows are orphaned `omp for` loops (each ending at its barrier), the activations' quantization and the silu
   run by every thread on the same inputs into its own scratch (mf_gguf_team_bytes(H, I) bytes, 64-byte aligned).
   Outside a parallel region it runs on the calling thread. x fp32 [H] (read by all), h fp32 [2I] and y fp32 [H]
   (shared scratch), out fp32 [H] (+)= weight * expert(x). Types must pass mf_gguf_supported. */
void mf_gguf_expert_team(const float* x, int H, int I, int t13, const uint8_t* gate, const uint8_t* up, int64_t s13,
                         int t2, const uint8_t* down, int64_t s2, float weight, float* out, int accumulate, float* h,
                         float* y, void* scratch) {
    char* p = scratch;
    acts ax, aa;
    acts1_carve(&ax, &p, H, t13);
    acts1_carve(&aa, &p, I, t2);
    float *hg = h, *hu = h + I;
    acts_row(&ax, x, 0);
    const int nc13 = (I + GROWS - 1) / GROWS, nc2 = (H + GROWS - 1) / GROWS;
#pragma omp for schedule(static)
    for (int c = 0; c < nc13; c++) {
        const int n0 = c * GROWS, n1 = n0 + GROWS < I ? n0 + GROWS : I;
        rows(t13, gate, s13, n0, n1, 1, &ax, hg, I);
        rows(t13, up, s13, n0, n1, 1, &ax, hu, I);
    }
    float* act = (float*)p;  /* [I] the silu output (mf_gguf_expert's, every thread its own copy) */
    mf_silu_mul(hg, hu, I, act);
    acts_row(&aa, act, 0);
#pragma omp for schedule(static)
    for (int c = 0; c < nc2; c++) {
        const int n0 = c * GROWS, n1 = n0 + GROWS < H ? n0 + GROWS : H;
        rows(t2, down, s2, n0, n1, 1, &aa, y, H);
        for (int n = n0; n < n1; n++) {
            const float v = weight * y[n];
            out[n] = accumulate ? out[n] + v : v;
        }
    }
}

/* ---- one token's linear rows inside an enclosing team (step_gptoss.c: gpt-oss's Q8_0 attention projections) -- */

/* The bytes of one token's activations for a linear of K inputs (mf_gguf_acts1's scratch, 64-byte aligned). */
size_t mf_gguf_acts1_bytes(int K) { return acts1_bytes(K); }

/* x fp32 [K] quantized for weights of `type` into scratch (mf_gguf_acts1_bytes(K) bytes): mf_gguf_linear's
   activations of one token. */
void mf_gguf_acts1(const float* x, int K, int type, void* scratch) {
    char* p = scratch;
    acts a;
    acts1_carve(&a, &p, K, type);
    acts_row(&a, x, 0);
}

/* Rows [n0, n1) of W [N, K] of `type` (rows `stride` bytes apart) against the token mf_gguf_acts1 quantized into
   scratch: y[n], mf_gguf_linear's numbers bit for bit (each row's operations its own). */
void mf_gguf_rows1(int type, const uint8_t* w, int64_t stride, int n0, int n1, int K, const void* scratch, float* y) {
    char* p = (char*)scratch;
    acts a;
    acts1_carve(&a, &p, K, type);
    rows(type, w, stride, n0, n1, 1, &a, y, 1);
}

/* Rows of W [N, K] (ggml `type`, rows `stride` bytes apart) against one token x fp32 [K] as an orphaned worksharing
   loop of the enclosing team, without its barrier: y fp32 [N], mf_gguf_linear's numbers at T = 1. Every thread
   quantizes x into its own scratch (mf_gguf_team_bytes(K, 0) bytes at the least, 64-byte aligned). The type must
   be one mf_gguf_linear takes for K (step_region.c's tail: a file's Q6_K lm_head). */
void mf_gguf_linear_team(const float* x, int K, int N, int type, const uint8_t* w, int64_t stride, float* y,
                         void* scratch) {
    char* p = scratch;
    acts a;
    acts1_carve(&a, &p, K, type);
    acts_row(&a, x, 0);
    const int nc = (N + GROWS - 1) / GROWS;
#pragma omp for schedule(static) nowait
    for (int c = 0; c < nc; c++) rows(type, w, stride, c * GROWS, (c + 1) * GROWS < N ? (c + 1) * GROWS : N, 1, &a, y, N);
}

/* ---- rows dequantized (a token embedding's lookup of K-quant blocks) --------------------------------------------- */

/* n rows of K-quant blocks (`stride` bytes apart, K values each) -> out fp32 [n, K], the fp32 operations of
   moeflow.quant.ggml's dequantize in its order (ggml's values): Q4_K / Q5_K (d sc) q - (dmin m) per 32 values,
   Q6_K (d sc) (q - 32) per 16. Scalar: a lookup reads a few rows. Returns 0, or -2 for another type or K not a
   multiple of 256. */
int mf_gguf_dequant_rows(int type, const uint8_t* rows, int n, int K, int64_t stride, float* out) {
    if ((type != GG_Q4_K && type != GG_Q5_K && type != GG_Q6_K) || K % QKK) return -2;
    for (int r = 0; r < n; r++)
        for (int b = 0; b < K / QKK; b++) {
            const uint8_t* w = rows + (size_t)r * stride + (size_t)b * type_bytes(type);
            float* y = out + (size_t)r * K + (size_t)b * QKK;
            if (type == GG_Q6_K) {
                const float d = h2f(w + 208);
                for (int n2 = 0; n2 < 2; n2++)
                    for (int j = 0; j < 4; j++)
                        for (int l = 0; l < 32; l++) {
                            const int p = 128 * n2 + 32 * j + l;
                            const int q = (((w[64 * n2 + 32 * (j % 2) + l] >> (4 * (j / 2))) & 15)
                                           | (((w[128 + 32 * n2 + l] >> (2 * j)) & 3) << 4)) - 32;
                            y[p] = (d * (float)(int8_t)w[192 + p / 16]) * (float)q;
                        }
                continue;
            }
            uint64_t sc8, mn8;
            k4_scales(w + 4, &sc8, &mn8);
            const float d = h2f(w), dmin = h2f(w + 2);
            const uint8_t* qs = w + (type == GG_Q4_K ? 16 : 48);
            for (int i = 0; i < 8; i++) {  /* sub-block i: nibbles (i % 2) of bytes 32 (i / 2) .. + 31 */
                const float ds = d * (float)((sc8 >> (8 * i)) & 0xFF), dm = dmin * (float)((mn8 >> (8 * i)) & 0xFF);
                for (int l = 0; l < 32; l++) {
                    int q = (qs[32 * (i / 2) + l] >> (4 * (i % 2))) & 15;
                    if (type == GG_Q5_K) q |= ((w[16 + l] >> i) & 1) << 4;
                    y[32 * i + l] = ds * (float)q - dm;
                }
            }
        }
    return 0;
}
