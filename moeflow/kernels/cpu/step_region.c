/* ---- a one-token decode step through every layer in one OpenMP parallel region (issue 42) ----

   mf_layers_step: the calls of step.c's mf_layers_step_calls (the per-layer path's ops), but where those open an
   OpenMP parallel region per kernel call (a fork, a join and the serial glue between them, dozens per token),
   here one team runs the whole step: the matrices' rows are shared out by orphaned `omp for` loops (static
   schedules: equal rows, so equal bytes, per thread; 16-row items, cache-line aligned outputs), and the small
   serial parts (the norms, the activations' int8 quantization, the router, the residual adds) run on every thread
   at once on the same inputs into its own buffers (a few microseconds, no barrier to wait for). A layer then waits
   at 3 to 5 barriers: after the attention (each thread its own kv heads: their q/k/v rows, cache rows and query
   heads, when the team divides the kv heads; else the rows split evenly, a barrier, then the heads), after
   o_proj, and after the experts: when the team divides k and there is no shared expert, each thread runs whole
   experts on its own; else every expert's rows are split across the team, with a barrier between gate/up and
   down.

   Numerics: every output element is computed by the same row kernel (mf_q4_rows, mf_q8_rows; a GGUF projection's
   mf_gguf_rows1), the same quantizer and the same fp32 operations in the same order as in the per-layer path, whatever thread runs it and
   however the rows are split: the same bits at any thread count (tests/test_cpu_layers.py).

   Layers with GGUF experts run each routed expert, in k order, as gguf.c's mf_gguf_expert_team (mf_gguf_expert's
   numbers at T = 1, its row loops orphaned `omp for` loops of this team, its activations quantized by every
   thread into its own scratch); a GGUF expert of a type it refuses, a layer mixing GGUF and q4 experts, or GGUF
   experts beside a shared expert take mf_layers_step_calls. */

#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "gguf.h"  /* mf_gguf_expert_team (gguf.c) */
#include "step.h"

typedef struct {  /* one token's int8 activations for a linear of up to K inputs (mf_quantize_row) */
    int8_t* q;
    float* s;
    float* gsum;
    int32_t* sum;
    void* gg;  /* an attention input's: gguf.c's mf_gguf_acts1 (a GGUF projection's activations), else NULL */
} acts1;

static size_t acts_bytes(int K) { return mf_up64((size_t)K) + 3 * mf_up64(sizeof(float) * (size_t)(K / QB)); }
static void acts_take(acts1* a, char** p, int K) {
    a->q = mf_take(p, (size_t)K);
    a->s = mf_take(p, sizeof(float) * (size_t)(K / QB));
    a->gsum = mf_take(p, sizeof(float) * (size_t)(K / QB));
    a->sum = mf_take(p, sizeof(int32_t) * (size_t)(K / QB));
    a->gg = NULL;
}
/* The activations a linear of `bits` (4: with its group's sums, as mf_q4_linear; 8: none, as mf_q8_linear). */
static void quantize(const float* x, int K, int bits, int group, acts1* a) {
    if (bits == 4)
        mf_quantize_row(x, K, group, a->q, a->s, a->gsum, a->sum);
    else
        mf_quantize_row(x, K, K, a->q, a->s, NULL, NULL);
}

/* x fp32 [K] as the linear's kernel quantizes it (mf_q4_linear's, mf_q8_linear's, mf_gguf_linear's). */
static void quantize_for(const mf_linear* l, const float* x, int K, acts1* a) {
    if (l->bits == MF_LINEAR_GGUF)
        mf_gguf_acts1(x, K, l->fmt, a->gg);
    else
        quantize(x, K, l->bits, l->group, a);
}

/* Rows [n0, n1) of a linear against one token: y[n]. */
static void linear_rows(const mf_linear* l, int n0, int n1, int K, const acts1* a, float* y) {
    if (l->bits == MF_LINEAR_GGUF)
        mf_gguf_rows1(l->fmt, (const uint8_t*)l->w, l->group, n0, n1, K, a->gg, y);
    else if (l->bits == 4)
        mf_q4_rows(n0, n1, 1, K, l->group, l->fmt, (const uint8_t*)l->w, l->s, l->m, a->q, a->s, a->gsum, a->sum, y,
                   l->n);
    else
        mf_q8_rows(n0, n1, 1, K, (const int8_t*)l->w, (const float*)l->s, a->q, a->s, y, l->n);
}

/* Rows [n0, n1) of a linear (+ b [l->n], one add per output, when b is not NULL): y [l->n]. */
static void linear_range(const mf_linear* l, int n0, int n1, int K, const acts1* a, const float* b, float* y) {
    linear_rows(l, n0, n1, K, a, y);
    if (b)
        for (int n = n0; n < n1; n++) y[n] += b[n];
}

/* y [l->n] = the linear's rows (+ b [l->n], one add per output, when b is not NULL), shared out among the team
   (an orphaned worksharing loop without its barrier). */
static void linear_for(const mf_linear* l, int K, const acts1* a, const float* b, float* y) {
    const int nc = mf_nchunks(l->n);
#pragma omp for schedule(static) nowait
    for (int c = 0; c < nc; c++) {
        const int n0 = c * MF_ROWS, n1 = n0 + MF_ROWS < l->n ? n0 + MF_ROWS : l->n;
        linear_range(l, n0, n1, K, a, b, y);
    }
}

typedef struct {  /* the buffers the whole team reads and writes */
    float *q, *att, *y, *moe, *h13, *ye;  /* [F], [nh D], [H], [H], [k + 1, 2 I], [k + 1, H] */
    size_t h13_ld;
} team_bufs;

typedef struct {  /* one thread's own buffers */
    float *x, *xa, *hn, *hm, *y, *qk, *abuf, *logits, *probs, *wts, *act, *h13;
    int32_t* ids;
    acts1 in[2];  /* a linear's input: q/k/v's (k/v's when they are a linear of their own), o's, the experts' */
    acts1* ea;    /* [k + 1]: each expert's silu output (the shared expert's last) */
    void* gg;     /* mf_gguf_expert_team's scratch */
} own_bufs;

typedef struct {  /* the largest sizes over the layers */
    int F, nhD, D, I, E, k, K;
} dims;

static size_t own_bytes(const dims* m, int H, int L) {
    return 5 * mf_up64(sizeof(float) * H) + mf_up64(sizeof(float) * m->F) +
           mf_up64(sizeof(float) * ((size_t)L + 2 * m->D)) +
           2 * mf_up64(sizeof(float) * m->E) + 2 * mf_up64(sizeof(float) * m->k) + mf_up64(sizeof(float) * m->I) +
           mf_up64(sizeof(float) * 2 * (size_t)m->I) + 2 * (acts_bytes(m->K) + mf_up64(mf_gguf_acts1_bytes(m->K))) +
           mf_up64(sizeof(acts1) * (m->k + 1)) +
           (size_t)(m->k + 1) * acts_bytes(m->I) + mf_up64(mf_gguf_team_bytes(H, m->I));
}
static void own_take(own_bufs* o, char* p, const dims* m, int H, int L) {
    float** hs[] = {&o->x, &o->xa, &o->hn, &o->hm, &o->y};
    for (int i = 0; i < 5; i++) *hs[i] = mf_take(&p, sizeof(float) * H);
    o->qk = mf_take(&p, sizeof(float) * m->F);
    o->abuf = mf_take(&p, sizeof(float) * ((size_t)L + 2 * m->D));
    o->logits = mf_take(&p, sizeof(float) * m->E);
    o->probs = mf_take(&p, sizeof(float) * m->E);
    o->wts = mf_take(&p, sizeof(float) * m->k);
    o->ids = mf_take(&p, sizeof(int32_t) * m->k);
    o->act = mf_take(&p, sizeof(float) * m->I);
    o->h13 = mf_take(&p, sizeof(float) * 2 * (size_t)m->I);
    for (int i = 0; i < 2; i++) {
        acts_take(&o->in[i], &p, m->K);
        o->in[i].gg = mf_take(&p, mf_gguf_acts1_bytes(m->K));
    }
    o->ea = mf_take(&p, sizeof(acts1) * (m->k + 1));
    for (int j = 0; j <= m->k; j++) acts_take(&o->ea[j], &p, m->I);
    o->gg = mf_take(&p, mf_gguf_team_bytes(H, m->I));
}

/* The attention half of a layer (mf_attn_block at B = T = 1), run by every thread of the team: x -> xa, hm (own
   buffers). */
static void attention_half(const mf_layer_desc* d, int H, const float* cos, const float* sin, float* kc, float* vc,
                           int L, int64_t pos, const uint8_t* mask, float scale, team_bufs* S, own_bufs* P, int tid,
                           int nth) {
    const int nh = d->nh, nkv = d->nkv, D = d->D, F = (nh + 2 * nkv) * D, nq = d->kv_bits ? nh * D : F;
    const mf_linear qkv = {d->qkv_bits, d->qkv_group, d->qkv_fmt, nq, d->qkv_w, d->qkv_s, d->qkv_m};
    const mf_linear kv = {d->kv_bits, d->kv_group, d->kv_fmt, F - nq, d->kv_w, d->kv_s, d->kv_m};
    const mf_linear o = {d->o_bits, d->o_group, d->o_fmt, H, d->o_w, d->o_s, d->o_m};
    mf_rmsnorm(P->x, NULL, NULL, d->w_in, d->eps, 1, H, P->hn);
    quantize_for(&qkv, P->hn, H, &P->in[0]);
    if (kv.bits) quantize_for(&kv, P->hn, H, &P->in[1]);  /* k and v a linear of their own (run_qkv) */
    const int groups = nh / nkv;
    /* When the team divides the kv heads (and the QK-norm, if any, is per head), each thread takes its own kv
       heads whole: their q, k and v rows, their cache rows and their query heads, with no barrier between the
       projection and the attention. Else the rows are split evenly, then the heads. */
    const int own = nkv % nth == 0 && d->qk != MF_QK_PROJ && D % Q4_GROUP == 0;
    const int g0 = own ? nkv * tid / nth : 0, g1 = own ? nkv * (tid + 1) / nth : nkv;
    const int seg[3][2] = {{g0 * groups * D, g1 * groups * D}, {(nh + g0) * D, (nh + g1) * D},
                           {(nh + nkv + g0) * D, (nh + nkv + g1) * D}};  /* its q, k, v rows */
    if (own) {
        for (int i = 0; i < 3; i++) {  /* (a segment lies in one of the two linears: nq is nh D or F) */
            if (seg[i][0] < nq)
                linear_range(&qkv, seg[i][0], seg[i][1], H, &P->in[0], d->qkv_b, S->q);
            else
                linear_range(&kv, seg[i][0] - nq, seg[i][1] - nq, H, &P->in[1], d->qkv_b ? d->qkv_b + nq : NULL,
                             S->q + nq);
        }
    } else {
        linear_for(&qkv, H, &P->in[0], d->qkv_b, S->q);
        if (kv.bits) linear_for(&kv, H, &P->in[1], d->qkv_b ? d->qkv_b + nq : NULL, S->q + nq);
#pragma omp barrier
    }
    const float* row = S->q;
    if (d->qk != MF_QK_NONE) {  /* mf_attn_step's QK-norm, on a copy of one's own (of its own heads' rows) */
        for (int i = 0; i < 3; i++)
            memcpy(P->qk + seg[i][0], S->q + seg[i][0], sizeof(float) * (seg[i][1] - seg[i][0]));
        float *q = P->qk + seg[0][0], *k = P->qk + seg[1][0];
        if (d->qk == MF_QK_HEAD) {
            mf_rmsnorm(q, NULL, NULL, d->qn, d->qk_eps, (g1 - g0) * groups, D, q);
            mf_rmsnorm(k, NULL, NULL, d->kn, d->qk_eps, g1 - g0, D, k);
        } else {
            mf_rmsnorm(q, NULL, NULL, d->qn, d->qk_eps, 1, nh * D, q);
            mf_rmsnorm(k, NULL, NULL, d->kn, d->qk_eps, 1, nkv * D, k);
        }
        row = P->qk;
    }
    const int keys = mf_mask_extent(mask, L);  /* the positions a head's scan reads (the rest are masked) */
    if (own) {
        for (int g = g0; g < g1; g++) {
            const size_t at = ((size_t)g * L + (size_t)pos) * D;
            mf_rotary(row + (size_t)(nh + g) * D, cos, sin, D, kc + at);
            memcpy(vc + at, row + (size_t)(nh + nkv + g) * D, sizeof(float) * D);
            for (int h = g * groups; h < (g + 1) * groups; h++)
                mf_attn_head(row + (size_t)h * D, cos, sin, D, mask, kc + (size_t)g * L * D, vc + (size_t)g * L * D,
                             keys, scale, P->abuf, S->att + (size_t)h * D);
        }
#pragma omp barrier
    } else {  /* the cache rows, then the query heads */
#pragma omp for schedule(static)
        for (int g = 0; g < nkv; g++) {
            const size_t at = ((size_t)g * L + (size_t)pos) * D;
            mf_rotary(row + (size_t)(nh + g) * D, cos, sin, D, kc + at);
            memcpy(vc + at, row + (size_t)(nh + nkv + g) * D, sizeof(float) * D);
        }
#pragma omp for schedule(static)
        for (int h = 0; h < nh; h++)
            mf_attn_head(row + (size_t)h * D, cos, sin, D, mask, kc + (size_t)(h / groups) * L * D,
                         vc + (size_t)(h / groups) * L * D, keys, scale, P->abuf, S->att + (size_t)h * D);
    }
    quantize_for(&o, S->att, nh * D, &P->in[0]);
    linear_for(&o, nh * D, &P->in[0], NULL, S->y);
#pragma omp barrier
    mf_rmsnorm(P->x, S->y, P->xa, d->w_post, d->eps, 1, H, P->hm);
}

/* rows [n0, n1) of an expert's w13 (K = H) or w2 (K = I) against one token. */
static void expert_rows(const mf_expert_desc* e, int down, int n0, int n1, int K, int N, int group, const acts1* a,
                        float* y) {
    mf_q4_rows(n0, n1, 1, K, group, e->fmt, down ? e->w2 : e->w13, down ? e->s2 : e->s13, down ? e->m2 : e->m13,
               a->q, a->s, a->gsum, a->sum, y, N);
}

/* The MoE half (the router, the k experts in k order, the shared expert; mf_layers_step_calls' sequence), run by
   every thread of the team: hm -> x = xa + moe (own buffers). */
static void moe_half(const mf_layer_desc* d, int H, team_bufs* S, own_bufs* P, int tid, int nth, int32_t* ids,
                     float* weights) {
    mf_dense_f32(P->hm, 1, H, d->E, d->gate, P->logits);
    mf_softmax_topk(P->logits, 1, d->E, d->k, d->renorm, P->probs, P->ids, P->wts);
    if (tid == 0) {
        memcpy(ids, P->ids, sizeof(int32_t) * d->k);
        memcpy(weights, P->wts, sizeof(float) * d->k);
    }
    const int k = d->k, I = d->I, G = d->group;
    const mf_expert_desc* sh = d->shared;
    if (d->experts[0].t13) {  /* GGUF experts (all of the layer's, no shared expert: mf_layers_step checks) */
        for (int j = 0; j < k; j++) {  /* each across the team, in k order, into moe (each ends at a barrier) */
            const mf_expert_desc* e = &d->experts[P->ids[j]];
            mf_gguf_expert_team(P->hm, H, I, e->t13, e->w13, e->up, e->gs13, e->t2, e->w2, e->gs2, P->wts[j], S->moe,
                                j > 0, S->h13, S->ye, P->gg);
        }
        for (int n = 0; n < H; n++) P->x[n] = P->xa[n] + S->moe[n];
        return;
    }
    quantize(P->hm, H, 4, G, &P->in[0]);
    if (!sh && k % nth == 0) {  /* whole experts per thread (one thread: the per-layer order): no barrier inside one */
        for (int j = tid; j < k; j += nth) {
            const mf_expert_desc* e = &d->experts[P->ids[j]];
            expert_rows(e, 0, 0, 2 * I, H, 2 * I, G, &P->in[0], P->h13);
            mf_silu_mul(P->h13, P->h13 + I, I, P->act);
            quantize(P->act, I, 4, G, &P->ea[0]);
            expert_rows(e, 1, 0, H, I, H, G, &P->ea[0], P->y);
            for (int n = 0; n < H; n++) S->ye[(size_t)j * H + n] = P->wts[j] * P->y[n];
        }
#pragma omp barrier
        for (int n = 0; n < H; n++) {
            float m = S->ye[n];
            for (int j = 1; j < k; j++) m = m + S->ye[(size_t)j * H + n];
            P->x[n] = P->xa[n] + m;
        }
        return;
    }
    /* every expert's rows across the team: gate/up rows, a barrier, then down rows with the weighted sum */
    const int sI = sh ? d->shared_I : 0, sG = sh ? d->shared_group : 0;
    const float gs = sh && d->shared_gate ? 1.0f / (1.0f + expf(-mf_dot(P->hm, d->shared_gate, H))) : 1.0f;
    if (sh) quantize(P->hm, H, 4, sG, &P->in[1]);
    for (int j = 0; j <= k; j++) {
        const mf_expert_desc* e = j < k ? &d->experts[P->ids[j]] : sh;
        if (!e) break;
        const int N = 2 * (j < k ? I : sI), nc = mf_nchunks(N);
#pragma omp for schedule(static) nowait
        for (int c = 0; c < nc; c++)
            expert_rows(e, 0, c * MF_ROWS, (c + 1) * MF_ROWS < N ? (c + 1) * MF_ROWS : N, H, N, j < k ? G : sG,
                        &P->in[j < k ? 0 : 1], S->h13 + (size_t)j * S->h13_ld);
    }
#pragma omp barrier
    for (int j = 0; j < k + (sh != NULL); j++) {
        const int Ij = j < k ? I : sI;
        mf_silu_mul(S->h13 + (size_t)j * S->h13_ld, S->h13 + (size_t)j * S->h13_ld + Ij, Ij, P->act);
        quantize(P->act, Ij, 4, j < k ? G : sG, &P->ea[j]);
    }
    /* this thread's rows of every down matrix: one stream per expert (interleaving the experts 16 rows at a time
       made the whole one-thread step ~20% slower, measured on the loaded machine), then their weighted sum */
    int n0, n1;
    mf_span(H, tid, nth, &n0, &n1);
    for (int j = 0; j < k; j++) {  /* mf_q4_expert's out (+)= weight * y, in k order */
        float* y = S->ye + (size_t)j * H;
        expert_rows(&d->experts[P->ids[j]], 1, n0, n1, I, H, G, &P->ea[j], y);
        for (int n = n0; n < n1; n++) {
            const float v = P->wts[j] * y[n];
            S->moe[n] = j ? S->moe[n] + v : v;
        }
    }
    if (sh) {  /* moe + the shared expert's gs * y (mf_shared_expert) */
        float* y = S->ye + (size_t)k * H;
        expert_rows(sh, 1, n0, n1, sI, H, sG, &P->ea[k], y);
        for (int n = n0; n < n1; n++) S->moe[n] = S->moe[n] + gs * y[n];
    }
#pragma omp barrier
    for (int n = 0; n < H; n++) P->x[n] = P->xa[n] + S->moe[n];
}

/* One token x fp32 [H] through n layers, in place (step.h; the arguments and results of mf_layers_step_calls,
   whose numbers these are bit for bit); then, when head is not NULL, the logits [head->head.n] (mf_decode_step). */
static int layers_region(const mf_layer_desc* layers, int n, float* x, int H, const float* cos, const float* sin,
                         void* const* kv, int L, const int64_t* pos, float scale, int32_t* ids, float* weights,
                         const mf_head_desc* head, float* logits, int nthreads) {
    dims m = {1, 1, 1, 1, 1, 1, H};
    for (int l = 0; l < n; l++) {
        const mf_layer_desc* d = &layers[l];
        int fall = d->shared && (d->shared->t13 || d->experts[0].t13);  /* (GGUF experts beside a shared one: the
            calls; no model takes that path yet) */
        for (int e = 0; e < d->E; e++) {
            const mf_expert_desc* x0 = &d->experts[0], *xe = &d->experts[e];
            fall |= (xe->t13 != 0) != (x0->t13 != 0) ||
                    (xe->t13 && mf_gguf_supported(xe->t13, H, xe->t2, d->I));
        }
        if (fall) {
            const int rc = mf_layers_step_calls(layers, n, x, H, cos, sin, kv, L, pos, scale, ids, weights, nthreads);
            return rc || !head ? rc : mf_head_calls(head, x, H, logits, nthreads);
        }
        const int F = (d->nh + 2 * d->nkv) * d->D, sI = d->shared ? d->shared_I : 0;
        const int v[6] = {F, d->nh * d->D, d->D, d->I > sI ? d->I : sI, d->E, d->k};
        int* mv[6] = {&m.F, &m.nhD, &m.D, &m.I, &m.E, &m.k};
        for (int i = 0; i < 6; i++) *mv[i] = v[i] > *mv[i] ? v[i] : *mv[i];
    }
    if (n <= 0) return head ? mf_head_calls(head, x, H, logits, nthreads) : 0;
    m.K = m.nhD > H ? m.nhD : H;
    const int nt = nthreads > 1 ? nthreads : 1;
    const size_t h13_ld = 2 * (size_t)m.I;
    const size_t team = mf_up64(sizeof(float) * m.F) + mf_up64(sizeof(float) * m.nhD) + 2 * mf_up64(sizeof(float) * H) +
                        mf_up64(sizeof(float) * (m.k + 1) * h13_ld) + mf_up64(sizeof(float) * (m.k + 1) * (size_t)H);
    const size_t own = own_bytes(&m, H, L), tail = head ? mf_head_team_bytes(H) : 0;
    char* mem = aligned_alloc(64, team + nt * (own + tail));
    if (!mem) return -1;
    char* p = mem;
    team_bufs S = {mf_take(&p, sizeof(float) * m.F), mf_take(&p, sizeof(float) * m.nhD), mf_take(&p, sizeof(float) * H),
                   mf_take(&p, sizeof(float) * H), mf_take(&p, sizeof(float) * (m.k + 1) * h13_ld),
                   mf_take(&p, sizeof(float) * (m.k + 1) * (size_t)H), h13_ld};
#pragma omp parallel num_threads(nt)
    {
        const int tid = omp_get_thread_num(), nth = omp_get_num_threads();
        own_bufs P;
        own_take(&P, mem + team + (size_t)tid * own, &m, H, L);
        memcpy(P.x, x, sizeof(float) * H);
        for (int l = 0; l < n; l++) {
            const mf_layer_desc* d = &layers[l];
            attention_half(d, H, cos, sin, (float*)kv[3 * l], (float*)kv[3 * l + 1], L, pos[0],
                           (const uint8_t*)kv[3 * l + 2], scale, &S, &P, tid, nth);
            moe_half(d, H, &S, &P, tid, nth, ids + (size_t)l * d->k, weights + (size_t)l * d->k);
        }
        if (tid == 0) memcpy(x, P.x, sizeof(float) * H);
        if (head) mf_head_team(head, P.x, H, logits, mem + team + nt * own + (size_t)tid * tail);
    }
    free(mem);
    return 0;
}

int mf_layers_step(const mf_layer_desc* layers, int n, float* x, int H, const float* cos, const float* sin,
                   void* const* kv, int L, const int64_t* pos, float scale, int32_t* ids, float* weights,
                   int nthreads) {
    return layers_region(layers, n, x, H, cos, sin, kv, L, pos, scale, ids, weights, NULL, NULL, nthreads);
}

/* mf_layers_step, then the final norm and the lm_head of one token in the same parallel region (step.h). */
int mf_decode_step(const mf_layer_desc* layers, int n, float* x, int H, const float* cos, const float* sin,
                   void* const* kv, int L, const int64_t* pos, float scale, int32_t* ids, float* weights,
                   const mf_head_desc* head, float* logits, int nthreads) {
    if (mf_head_check(head, H)) return -2;
    return layers_region(layers, n, x, H, cos, sin, kv, L, pos, scale, ids, weights, head, logits, nthreads);
}
