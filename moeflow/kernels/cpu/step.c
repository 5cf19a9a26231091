/* ---- decode-step ops ---- */
/* The per-layer glue of a CPU decode step in one call each (issue 21; step.py holds their fp32 torch
   models): RMSNorm (with the residual add before it), rotary + KV-cache write + attention over the static
   cache, a layer's whole attention half, and a plain softmax-top-k router. Built into the same library as
   native.c (native.py's build), whose linear kernels the attention half calls. */

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "gguf.h"  /* mf_gguf_expert (gguf.c); includes native.h */
#include "step.h"

/* out[t] = w * (x[t] / sqrt(mean(x[t]^2) + eps)) for x fp32 [T, H]. With ``res`` (may be NULL): x[t] + res[t]
   is normalised instead and written to ``sum`` (the residual stream the layer continues with). ``out`` may be
   ``x`` (in place, without ``res``). */
void mf_rmsnorm(const float* x, const float* res, float* sum, const float* w, float eps, int T, int H, float* out) {
    for (int t = 0; t < T; t++) {
        const float* xt = x + (size_t)t * H;
        float* ot = out + (size_t)t * H;
        if (res) {
            const float* rt = res + (size_t)t * H;
            float* st = sum + (size_t)t * H;
            for (int i = 0; i < H; i++) st[i] = xt[i] + rt[i];
            xt = st;
        }
        double ss = 0.0;  /* H values of either sign: a double sum keeps the mean exact to fp32 */
        for (int i = 0; i < H; i++) ss += (double)xt[i] * xt[i];
        float r = 1.0f / sqrtf((float)(ss / H) + eps);
        for (int i = 0; i < H; i++) ot[i] = w[i] * (xt[i] * r);
    }
}

/* x [D] -> y [D]: y = x * cos + rotate_half(x) * sin (rotate_half(x) = [-x[D/2:], x[:D/2]]), the products
   rounded before the sum as torch's unfused ops do. */
void mf_rotary(const float* x, const float* c, const float* s, int D, float* y) {
    int h = D / 2;
    for (int i = 0; i < h; i++) y[i] = x[i] * c[i] + (-x[i + h]) * s[i];
    for (int i = h; i < D; i++) y[i] = x[i] * c[i] + x[i - h] * s[i];
}

/* q . k over D features in 8 interleaved partial sums (vectorizable without reordering a single sum). */
float mf_dot(const float* q, const float* k, int D) {
    float part[8] = {0};
    int j = 0;
    for (; j + 8 <= D; j += 8)
        for (int u = 0; u < 8; u++) part[u] += q[j + u] * k[j + u];
    float d = ((part[0] + part[1]) + (part[2] + part[3])) + ((part[4] + part[5]) + (part[6] + part[7]));
    for (; j < D; j++) d += q[j] * k[j];
    return d;
}

/* 1 + the last set position of the mask row m [L] (0 when none). The positions after it are never read by
   mf_attn_head, so bounding its scan there gives the same numbers (mf_exp8 is expf bit for bit: the scores' exp
   does not depend on where the vector loop stops) while a long cache holding a short sequence (a serving row of
   4096 positions, generate with a large max_new_tokens) costs what the sequence's own positions cost. */
int mf_mask_extent(const uint8_t* m, int L) {
    for (uint64_t w; L >= 8; L -= 8) {  /* 8 positions a word from the end */
        memcpy(&w, m + L - 8, sizeof(w));
        if (w) break;
    }
    while (L > 0 && !m[L - 1]) L--;
    return L;
}

/* One query head over the cache: q = rotary(qh [D]) (c, s [D]); o [D] = softmax(q k^T * scale) v over the positions
   l < L with mrow[l] (kh, vh fp32 [L, D]: the head's kv cache); buf: L + 2 D floats of scratch. */
void mf_attn_head(const float* qh, const float* c, const float* s, int D, const uint8_t* mrow, const float* kh,
                  const float* vh, int L, float scale, float* buf, float* o) {
    float* p = buf;
    float* q = buf + L;
    float* acc = q + D;
    mf_rotary(qh, c, s, D, q);
    float mx = -INFINITY;
    for (int l = 0; l < L; l++) {
        if (!mrow[l]) {
            p[l] = 0.0f;  /* never read below; a plain value keeps mf_exp8 on its fast path */
            continue;
        }
        const float sc = mf_dot(q, kh + (size_t)l * D, D) * scale;
        p[l] = sc;
        mx = mx > sc ? mx : sc;  /* fmaxf(mx, sc) (x86 glibc: maxss) for scores that are not NaN */
    }
    int l0 = 0;  /* p[l] = expf(p[l] - mx) */
#if MF_AVX2
    for (const __m256 m8 = _mm256_set1_ps(mx); l0 + 8 <= L; l0 += 8)
        _mm256_storeu_ps(p + l0, mf_exp8(_mm256_sub_ps(_mm256_loadu_ps(p + l0), m8)));
#endif
    for (; l0 < L; l0++) p[l0] = expf(p[l0] - mx);
    float den = 0.0f;
    for (int j = 0; j < D; j++) acc[j] = 0.0f;
    for (int l = 0; l < L; l++) {
        if (!mrow[l]) continue;
        const float e = p[l];
        den += e;
        const float* vl = vh + (size_t)l * D;
        for (int j = 0; j < D; j++) acc[j] += e * vl[j];
    }
    for (int j = 0; j < D; j++) o[j] = acc[j] / den;
}

/* One attention layer's step after its fused q/k/v projection.
   qkv fp32 [B, T, (nh + 2 nkv) D] (q heads, then k heads, then v heads); cos, sin fp32 [B, T, D];
   kc, vc fp32 [B, nkv, L, D]: this layer's static cache, written at positions pos int64 [T] (rotated keys);
   mask bool [B, T, L]: which cache positions each query sees; out fp32 [B, T, nh D]: softmax(q k^T * scale) v
   per head, query head h reading kv head h / (nh / nkv). QK-norm before the rotary (qk, qn fp32, kn fp32,
   qk_eps): qk MF_QK_HEAD: q and k RMSNormed per head over D (weights [D], Qwen3); MF_QK_PROJ: over each token's
   whole q projection (nh D, weights [nh D]) and k projection (nkv D, weights [nkv D]), OLMoE; MF_QK_NONE (0): none
   (qn, kn unread). The norm is mf_rmsnorm on those rows (the op the per-layer path's q_norm / k_norm modules run).
   Returns 0, or -1 when out of memory. */
int mf_attn_step(const float* qkv, int B, int T, int nh, int nkv, int D, const float* cos, const float* sin,
                 float* kc, float* vc, int L, const int64_t* pos, const uint8_t* mask, float scale, int qk,
                 const float* qn, const float* kn, float qk_eps, float* out, int nthreads) {
    int F = (nh + 2 * nkv) * D, groups = nh / nkv;
    float* normed = NULL;
    if (qk != MF_QK_NONE) {
        normed = malloc(sizeof(float) * (size_t)B * T * F);
        if (!normed) return -1;
        memcpy(normed, qkv, sizeof(float) * (size_t)B * T * F);
        for (size_t r = 0; r < (size_t)B * T; r++) {
            float* q = normed + r * F;
            float* k = q + (size_t)nh * D;
            if (qk == MF_QK_HEAD) {
                mf_rmsnorm(q, NULL, NULL, qn, qk_eps, nh, D, q);
                mf_rmsnorm(k, NULL, NULL, kn, qk_eps, nkv, D, k);
            } else {
                mf_rmsnorm(q, NULL, NULL, qn, qk_eps, 1, nh * D, q);
                mf_rmsnorm(k, NULL, NULL, kn, qk_eps, 1, nkv * D, k);
            }
        }
        qkv = normed;
    }
    for (int b = 0; b < B; b++)
        for (int t = 0; t < T; t++) {
            const float* row = qkv + ((size_t)b * T + t) * F;
            const float* c = cos + ((size_t)b * T + t) * D;
            const float* s = sin + ((size_t)b * T + t) * D;
            for (int h = 0; h < nkv; h++) {
                size_t at = (((size_t)b * nkv + h) * L + (size_t)pos[t]) * D;
                mf_rotary(row + (size_t)(nh + h) * D, c, s, D, kc + at);
                memcpy(vc + at, row + (size_t)(nh + nkv + h) * D, sizeof(float) * D);
            }
        }
    int fail = 0;
    /* heads in parallel from ~16K score terms (32 heads of 32 features: 16 positions); below, the fork costs more */
#pragma omp parallel num_threads(nthreads) if (B * T * nh > 1 && (size_t)B * T * nh * L * D >= 16384)
    {
        float* buf = malloc(sizeof(float) * ((size_t)L + 2 * (size_t)D));
        if (!buf) {
#pragma omp atomic write
            fail = 1;
        }
#pragma omp for schedule(static)
        for (int i = 0; i < B * T * nh; i++) {
            if (!buf) continue;
            int b = i / (T * nh), t = (i / nh) % T, h = i % nh, kvh = h / groups;
            const float* row = qkv + ((size_t)b * T + t) * F;
            mf_attn_head(row + (size_t)h * D, cos + ((size_t)b * T + t) * D, sin + ((size_t)b * T + t) * D, D,
                         mask + ((size_t)b * T + t) * L, kc + ((size_t)b * nkv + kvh) * L * D,
                         vc + ((size_t)b * nkv + kvh) * L * D, mf_mask_extent(mask + ((size_t)b * T + t) * L, L),
                         scale, buf,
                         out + ((size_t)b * T + t) * nh * D + (size_t)h * D);
        }
        free(buf);
    }
    free(normed);
    return fail ? -1 : 0;
}

static int run_linear(const mf_linear* l, const float* x, int T, int K, float* y, int nthreads) {
    if (l->bits == MF_LINEAR_GGUF)
        return mf_gguf_linear(x, T, K, l->n, l->fmt, (const uint8_t*)l->w, l->group, y, nthreads);
    if (l->bits == 4)
        return mf_q4_linear(x, T, K, l->n, l->group, l->fmt, (const uint8_t*)l->w, l->s, l->m, y, nthreads);
    return mf_q8_linear(x, T, K, l->n, (const int8_t*)l->w, (const float*)l->s, y, nthreads);
}

/* The q/k/v projection h fp32 [BT, K] -> q fp32 [BT, F]: one linear of F rows, or (kv->bits != 0) q's rows
   (qkv, nh D of them) and k's and v's (kv, F - nh D) in two linears of their own forms (a GGUF file's Q4_0 q beside
   Q8_0 k and v), their outputs side by side per token: each row's numbers as in one matrix (a row's result does
   not depend on the other rows). */
static int run_qkv(const mf_linear* qkv, const mf_linear* kv, const float* h, int BT, int K, float* q,
                   int nthreads) {
    if (!kv->bits) return run_linear(qkv, h, BT, K, q, nthreads);
    const int nq = qkv->n, nk = kv->n, F = nq + nk;
    if (BT == 1) {
        int rc = run_linear(qkv, h, 1, K, q, nthreads);
        return rc ? rc : run_linear(kv, h, 1, K, q + nq, nthreads);
    }
    float* tmp = malloc(sizeof(float) * (size_t)BT * F);
    if (!tmp) return -1;
    int rc = run_linear(qkv, h, BT, K, tmp, nthreads);
    if (!rc) rc = run_linear(kv, h, BT, K, tmp + (size_t)BT * nq, nthreads);
    for (int t = 0; t < BT && !rc; t++) {
        memcpy(q + (size_t)t * F, tmp + (size_t)t * nq, sizeof(float) * nq);
        memcpy(q + (size_t)t * F + nq, tmp + (size_t)BT * nq + (size_t)t * nk, sizeof(float) * nk);
    }
    free(tmp);
    return rc;
}

/* A decoder layer's attention half in one call, for x fp32 [B, T, H] (the layer's input):
   h = rmsnorm(x, w_in); qkv = h @ Wqkv.T; a = attention (mf_attn_step, writing the cache); o = a @ Wo.T;
   x_out = x + o; h_out = rmsnorm(x_out, w_post) (the MoE block's input). Exactly the sequence of the
   separate calls, so the same numbers. qkv_b fp32 [F] or NULL: the q/k/v bias (Qwen2-MoE), added after the
   projection. qk, qn, kn, qk_eps: the QK-norm (mf_attn_step). kv_bits 0: Wqkv is the
   one qkv linear; else qkv holds q's rows and kv
   k's and v's (run_qkv). Returns 0, or -1 when out of memory. */
int mf_attn_block(const float* x, int B, int T, int H, const float* w_in, const float* w_post, float eps,
                  int qkv_bits, int qkv_group, int qkv_fmt, const void* qkv_w, const void* qkv_s, const void* qkv_m,
                  int kv_bits, int kv_group, int kv_fmt, const void* kv_w, const void* kv_s, const void* kv_m,
                  int o_bits, int o_group, int o_fmt, const void* o_w, const void* o_s, const void* o_m,
                  int nh, int nkv, int D, const float* qkv_b, int qk, const float* qn, const float* kn,
                  float qk_eps, const float* cos, const float* sin, float* kc, float* vc, int L,
                  const int64_t* pos, const uint8_t* mask, float scale, float* x_out, float* h_out,
                  int nthreads) {
    int BT = B * T, F = (nh + 2 * nkv) * D;
    mf_linear qkv = {qkv_bits, qkv_group, qkv_fmt, kv_bits ? nh * D : F, qkv_w, qkv_s, qkv_m};
    mf_linear kv = {kv_bits, kv_group, kv_fmt, 2 * nkv * D, kv_w, kv_s, kv_m};
    mf_linear o = {o_bits, o_group, o_fmt, H, o_w, o_s, o_m};
    float* buf = malloc(sizeof(float) * ((size_t)BT * H * 2 + (size_t)BT * F + (size_t)BT * nh * D));
    if (!buf) return -1;
    float* h = buf;                            /* [BT, H] */
    float* q = h + (size_t)BT * H;             /* [BT, F] */
    float* a = q + (size_t)BT * F;             /* [BT, nh D] */
    float* y = a + (size_t)BT * nh * D;        /* [BT, H] */
    mf_rmsnorm(x, NULL, NULL, w_in, eps, BT, H, h);
    int rc = run_qkv(&qkv, &kv, h, BT, H, q, nthreads);
    if (!rc && qkv_b)  /* the projection's bias, one fp32 add per output (CpuQuantLinear's ``y += bias``) */
        for (int t = 0; t < BT; t++)
            for (int j = 0; j < F; j++) q[(size_t)t * F + j] += qkv_b[j];
    if (!rc) rc = mf_attn_step(q, B, T, nh, nkv, D, cos, sin, kc, vc, L, pos, mask, scale, qk, qn, kn, qk_eps, a,
                               nthreads);
    if (!rc) rc = run_linear(&o, a, BT, nh * D, y, nthreads);
    if (!rc) mf_rmsnorm(x, y, x_out, w_post, eps, BT, H, h_out);
    free(buf);
    return rc;
}

/* y fp32 [T, N] = x fp32 [T, K] @ w.T for a small fp32 matrix w [N, K] (a router: N = experts). */
void mf_dense_f32(const float* x, int T, int K, int N, const float* w, float* y) {
    for (int t = 0; t < T; t++)
        for (int n = 0; n < N; n++) y[(size_t)t * N + n] = mf_dot(x + (size_t)t * K, w + (size_t)n * K, K);
}

/* A dense SwiGLU MLP on q4 matrices (a shared expert; Qwen2-MoE's with its sigmoid output gate) for x fp32 [T, H]:
   out[t] (+)= g[t] * (silu(x W_gate) * (x W_up)) W_down, one mf_q4_expert call (w13 [2I, H] gate then up rows, w2
   [H, I], both of form fmt), g[t] = 1 / (1 + expf(-(x[t] . gate))) for gate fp32 [H], or 1 when gate is NULL.
   Returns 0, or -1 when out of memory. */
int mf_shared_expert(const float* x, int T, int H, int I, int group, int fmt, const uint8_t* w13, const void* s13,
                     const void* m13, const uint8_t* w2, const void* s2, const void* m2, const float* gate, float* out,
                     int accumulate, int nthreads) {
    float* g = malloc(sizeof(float) * (size_t)T);
    if (!g) return -1;
    for (int t = 0; t < T; t++) g[t] = gate ? 1.0f / (1.0f + expf(-mf_dot(x + (size_t)t * H, gate, H))) : 1.0f;
    int rc = mf_q4_expert(x, T, H, I, group, fmt, w13, s13, m13, w2, s2, m2, g, out, accumulate, nthreads);
    free(g);
    return rc;
}

/* Softmax routing per token: probs = softmax(logits [T, E]) in fp32; ids int32 [T, k]: the k largest
   probabilities, largest first (the lower expert index first among equals); weights fp32 [T, k] their
   probabilities, divided by their sum when ``renorm``. */
void mf_softmax_topk(const float* logits, int T, int E, int k, int renorm, float* probs, int32_t* ids,
                     float* weights) {
    for (int t = 0; t < T; t++) {
        const float* l = logits + (size_t)t * E;
        float* p = probs + (size_t)t * E;
        float mx = -INFINITY, sum = 0.0f;
        for (int e = 0; e < E; e++) mx = fmaxf(mx, l[e]);
        for (int e = 0; e < E; e++) { p[e] = expf(l[e] - mx); sum += p[e]; }
        for (int e = 0; e < E; e++) p[e] /= sum;
        int32_t* it = ids + (size_t)t * k;
        float* wt = weights + (size_t)t * k;
        float total = 0.0f;
        for (int j = 0; j < k; j++) {
            int best = -1;
            for (int e = 0; e < E; e++) {
                int taken = 0;
                for (int i = 0; i < j; i++) taken |= it[i] == e;
                if (!taken && (best < 0 || p[e] > p[best])) best = e;
            }
            it[j] = best;
            wt[j] = p[best];
            total += p[best];
        }
        if (renorm)
            for (int j = 0; j < k; j++) wt[j] /= total;
    }
}

/* ---- a whole one-token step through the decoder layers ---- */

/* One token x fp32 [H] through n layers, in place: per layer, (x, h) = mf_attn_block(x); logits = h @ gate.T;
   (ids, weights) = mf_softmax_topk(logits); moe = the k experts' mf_q4_expert (or mf_gguf_expert) calls
   accumulated in k order; with a shared expert, moe = moe + mf_shared_expert(h) (MoEBlock's ``out + shared``);
   x = x + moe. Exactly the calls (and the one fp32 add) of the per-layer path, so the same numbers.
   kv [n, 3]: each layer's k cache, v cache (fp32 [1, nkv, L, D]) and mask (bool [L]); ids int32 [n, k] and
   weights fp32 [n, k] receive each layer's routing. Returns 0, -1 when out of memory, -2 when a GGUF expert's
   type or size is refused (x then undefined). */
int mf_layers_step_calls(const mf_layer_desc* layers, int n, float* x, int H, const float* cos, const float* sin,
                         void* const* kv, int L, const int64_t* pos, float scale, int32_t* ids, float* weights,
                         int nthreads) {
    int emax = 1;
    for (int l = 0; l < n; l++) emax = layers[l].E > emax ? layers[l].E : emax;
    float* buf = malloc(sizeof(float) * (5 * (size_t)H + 2 * (size_t)emax));
    if (!buf) return -1;
    float* xa = buf;           /* [H] x + attention */
    float* h = xa + H;         /* [H] the MoE block's input */
    float* moe = h + H;        /* [H] */
    float* sh = moe + H;       /* [H] the shared expert's output */
    float* logits = sh + H;    /* [E] */
    float* probs = logits + emax;
    int rc = 0;
    for (int l = 0; l < n && !rc; l++) {
        const mf_layer_desc* d = &layers[l];
        rc = mf_attn_block(x, 1, 1, H, d->w_in, d->w_post, d->eps, d->qkv_bits, d->qkv_group, d->qkv_fmt, d->qkv_w,
                           d->qkv_s, d->qkv_m, d->kv_bits, d->kv_group, d->kv_fmt, d->kv_w, d->kv_s, d->kv_m,
                           d->o_bits, d->o_group, d->o_fmt, d->o_w, d->o_s, d->o_m, d->nh, d->nkv,
                           d->D, d->qkv_b, d->qk, d->qn, d->kn, d->qk_eps, cos, sin,
                           (float*)kv[3 * l], (float*)kv[3 * l + 1], L, pos, (const uint8_t*)kv[3 * l + 2], scale,
                           xa, h, nthreads);
        if (rc) break;
        int32_t* il = ids + (size_t)l * d->k;
        float* wl = weights + (size_t)l * d->k;
        mf_dense_f32(h, 1, H, d->E, d->gate, logits);
        mf_softmax_topk(logits, 1, d->E, d->k, d->renorm, probs, il, wl);
        for (int j = 0; j < d->k && !rc; j++) {
            const mf_expert_desc* e = &d->experts[il[j]];
            rc = e->t13 ? mf_gguf_expert(h, 1, H, d->I, e->t13, e->w13, e->up, e->gs13, e->t2, e->w2, e->gs2, wl + j,
                                         moe, j > 0, nthreads)
                        : mf_q4_expert(h, 1, H, d->I, d->group, e->fmt, e->w13, e->s13, e->m13, e->w2, e->s2, e->m2,
                                       wl + j, moe, j > 0, nthreads);
        }
        if (!rc && d->shared) {
            const mf_expert_desc* s = d->shared;
            rc = mf_shared_expert(h, 1, H, d->shared_I, d->shared_group, s->fmt, s->w13, s->s13, s->m13, s->w2, s->s2,
                                  s->m2, d->shared_gate, sh, 0, nthreads);
            for (int i = 0; i < H; i++) moe[i] = moe[i] + sh[i];
        }
        for (int i = 0; i < H; i++) x[i] = xa[i] + moe[i];
    }
    free(buf);
    return rc;
}
