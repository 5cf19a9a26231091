/* The native MXFP4 expert's work outside the weight rows (mxfp4.c has the rows and the entry points):
   - the activations quantized to int8 per block of 32 (scale xs = max|x| / 127, round half to even, as gguf.c) and
     stored permuted the way mxfp4.c's decode gives the codes (quantize_row), once per token;
   - the expert's epilogue in fp32 (8 features at a time on AVX2, mf_exp8 = expf): h + bias (gate rows first, then
     up, as the format stores them), the gate activation (MX_SILU: silu(g) u; MX_SWIGLU, gpt-oss:
     g' = min(g, limit), u' = clamp(u, -limit, limit), (u' + 1) g' sigmoid(alpha g')), libm's expf; then down,
     + bias, times the routing weight.
   The same operations on every build (tests/test_cpu_isa.py compares bits). */

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "mxfp4.h"

static const int PERM0[4] = {4, 2, 5, 3}, PERM1[4] = {0, 6, 1, 7};  /* code of a word at byte i of its lane */

/* ---- activations ------------------------------------------------------------------------------------------- */

/* One block of 32 to int8 (q) and its scale. AVX2: max_ps keeps amax on a nan x as fmaxf does (the max is exact in
   any order); round to nearest even, truncate to int32, keep the low byte (0 for a nan's 0x80000000), as the cast. */
static void quant32(const float* x, int8_t* q, float* xs) {
    float amax = 0.0f;
#if MF_AVX2
    __m256 v[4], m = _mm256_setzero_ps(), sign = _mm256_set1_ps(-0.0f);
    for (int i = 0; i < 4; i++) v[i] = _mm256_loadu_ps(x + 8 * i), m = _mm256_max_ps(_mm256_andnot_ps(sign, v[i]), m);
    __m128 h = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
    h = _mm_max_ps(h, _mm_movehl_ps(h, h));
    amax = _mm_cvtss_f32(_mm_max_ss(h, _mm_movehdup_ps(h)));
    const __m256 inv = _mm256_set1_ps(amax > 0.0f ? 127.0f / amax : 0.0f);
    __m256i r[4];
    for (int i = 0; i < 4; i++)  /* the low bytes, packed per 128-bit lane: quads (0-3 8-11 16-19 24-27 4-7 ...) */
        r[i] = _mm256_and_si256(_mm256_cvttps_epi32(_mm256_round_ps(_mm256_mul_ps(v[i], inv), _MM_FROUND_TO_NEAREST_INT
                                                                    | _MM_FROUND_NO_EXC)), _mm256_set1_epi32(0xFF));
    const __m256i b = _mm256_packus_epi16(_mm256_packus_epi32(r[0], r[1]), _mm256_packus_epi32(r[2], r[3]));
    _mm256_storeu_si256((__m256i*)q, _mm256_shuffle_epi32(_mm256_permute4x64_epi64(b, 0xD8), 0xD8));
#else
    for (int i = 0; i < 32; i++) amax = fmaxf(amax, fabsf(x[i]));
    const float inv = amax > 0.0f ? 127.0f / amax : 0.0f;
    for (int i = 0; i < 32; i++) q[i] = (int8_t)(int)nearbyintf(x[i] * inv);
#endif
    xs[0] = xs[1] = xs[2] = xs[3] = amax / 127.0f;
}

static void quantize_row(const float* x, int K, int8_t* xp, float* xs) {
    const int nb = K / 32, nbp = (nb + 1) / 2;
    int8_t q[64];
    for (int bp = 0; bp < nbp; bp++) {
        memset(q, 0, sizeof q);
        for (int h = 0; h < 2; h++) {
            const int b = 2 * bp + h;
            float* xsb = xs + (size_t)bp * 8 + 4 * h;
            if (b >= nb) xsb[0] = xsb[1] = xsb[2] = xsb[3] = 0.0f;
            else quant32(x + (size_t)b * 32, q + 32 * h, xsb);
        }
        int8_t* o = xp + (size_t)bp * 64;
        for (int l = 0; l < 8; l++)
            for (int i = 0; i < 4; i++) {
                o[4 * l + i] = q[8 * l + PERM0[i]];
                o[32 + 4 * l + i] = q[8 * l + PERM1[i]];
            }
    }
}

int mx_acts_alloc(mxacts* a, int T, int K) {
    a->nbp = (K / 32 + 1) / 2;
    a->q = malloc((size_t)T * a->nbp * 64);
    a->s = malloc(sizeof(float) * (size_t)T * 8 * a->nbp);
    return a->q && a->s ? 0 : -1;
}
void mx_acts_free(mxacts* a) { free(a->q); free(a->s); }
void mx_acts_row(mxacts* a, const float* x, int K, int t) {
    quantize_row(x, K, a->q + (size_t)t * a->nbp * 64, a->s + (size_t)t * 8 * a->nbp);
}

/* ---- epilogue -------------------------------------------------------------------------------------------- */

MXI float bias_at(const void* bias, int kind, int i) {
    if (kind == MX_BIAS_F32) return ((const float*)bias)[i];
    const uint16_t h = ((const uint16_t*)bias)[i];
    if (kind == MX_BIAS_F16) return mf_half_to_float(h);
    const uint32_t bits = (uint32_t)h << 16;
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

#if MF_AVX2
MXI __m256 bias8(const void* bias, int kind, int i) {  /* bias_at(bias, kind, i .. i + 7); f16 as bias_at does */
    float v[8];
    if (kind == MX_BIAS_F32) return _mm256_loadu_ps((const float*)bias + i);
    if (kind == MX_BIAS_BF16) return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128(
                                  (const __m128i*)((const uint16_t*)bias + i))), 16));
    for (int l = 0; l < 8; l++) v[l] = bias_at(bias, kind, i + l);
    return _mm256_loadu_ps(v);
}

/* The epilogue's gate activation for 8 features j .. j + 7 (g at g8, u at u8): the scalar loop's operations in its
   order, mf_exp8 (libm's expf bit for bit); min/max_ps take the scalar fminf/fmaxf's operand on a nan g or u. */
MXI void act8(const float* g8, const float* u8, float* o, const void* bias, int kind, int j, int I, int act,
              float alpha, float limit) {
    __m256 g = _mm256_loadu_ps(g8), u = _mm256_loadu_ps(u8);
    if (bias) { g = _mm256_add_ps(g, bias8(bias, kind, j)); u = _mm256_add_ps(u, bias8(bias, kind, I + j)); }
    const __m256 one = _mm256_set1_ps(1.0f), sign = _mm256_set1_ps(-0.0f);
    if (act == MX_SILU) {
        const __m256 sig = _mm256_div_ps(one, _mm256_add_ps(one, mf_exp8(_mm256_xor_ps(g, sign))));
        _mm256_storeu_ps(o, _mm256_mul_ps(_mm256_mul_ps(g, sig), u));
    } else {
        const __m256 lim = _mm256_set1_ps(limit);
        g = _mm256_min_ps(g, lim);
        u = _mm256_min_ps(_mm256_max_ps(u, _mm256_xor_ps(lim, sign)), lim);
        const __m256 e = mf_exp8(_mm256_xor_ps(_mm256_mul_ps(g, _mm256_set1_ps(alpha)), sign));
        const __m256 sig = _mm256_div_ps(one, _mm256_add_ps(one, e));
        _mm256_storeu_ps(o, _mm256_mul_ps(_mm256_add_ps(u, one), _mm256_mul_ps(g, sig)));
    }
}
#endif

void mx_gate_up(const float* ht, float* at, int I, const void* bias13, int bias_kind, int act, float alpha,
                float limit) {
    int j = 0;
#if MF_AVX2
    for (; j + 8 <= I; j += 8) act8(ht + j, ht + I + j, at + j, bias13, bias_kind, j, I, act, alpha, limit);
#endif
    for (; j < I; j++) {
        float g = ht[j], u = ht[I + j];
        if (bias13) { g += bias_at(bias13, bias_kind, j); u += bias_at(bias13, bias_kind, I + j); }
        if (act == MX_SILU) {
            at[j] = g * (1.0f / (1.0f + expf(-g))) * u;
        } else {
            g = fminf(g, limit);
            u = fminf(fmaxf(u, -limit), limit);
            at[j] = (u + 1.0f) * (g * (1.0f / (1.0f + expf(-(g * alpha)))));
        }
    }
}

void mx_down_out(const float* y, int T, int H, int n0, int n1, const void* bias2, int bias_kind, const float* weight,
                 float* out, int accumulate) {
    for (int t = 0; t < T; t++)
        for (int n = n0; n < n1; n++) {
            float v = y[(size_t)t * H + n];
            if (bias2) v += bias_at(bias2, bias_kind, n);
            v *= weight[t];
            out[(size_t)t * H + n] = accumulate ? out[(size_t)t * H + n] + v : v;
        }
}
