/* ---- gpt-oss: a one-token decode step through every layer in one OpenMP parallel region (issue 42) ----

   mf_gptoss_step does for gpt-oss layers what step_region.c's mf_layers_step does for the Mixtral layout: one
   team runs every layer of the step, the matrices' rows shared out by orphaned `omp for` loops, the small serial
   parts (the norms, the activations' quantization, the router, the residual adds) run by every thread on the same
   inputs into its own buffers. A gpt-oss layer (moeflow/families/gpt_oss.py):

     h = rmsnorm(x) ; q, k, v = h Wq.T + bq, h Wk.T + bk, h Wv.T + bv (each projection an int8 / int4 matrix of
       native.c or a GGUF file's blocks of gguf.c, mf_proj) ; rotary on q and k ; k, v written at the position
     attention per query head with a sink: softmax over the visible keys' scores and the head's sink logit (max
       subtracted first), the sink's share dropped; the layer's mask row holds its sliding window
     x = x + (att Wo.T + bo) ; h = rmsnorm(x)
     router: logits = h G.T + g (fp32), the top k logits (largest first, the lower index first among equals),
       their softmax as the weights
     experts (MXFP4, mxfp4.c's region layout): out_j = w_j (act(h W13.T + b13) W2.T + b2) with gpt-oss's clamped
       SwiGLU (mx_gate_up), summed in k order ; x = x + sum.

   Barriers per layer: after q/k/v, after the cache rows, after the heads, after o, then, when the team divides k,
   after the experts (each thread its own whole experts), else after the experts' gate/up rows (every expert's
   rows split across the team) and after their down rows. Each output element is computed by the same row kernels
   (mf_q8_rows, mf_q4_rows, mf_gguf_rows1, mf_mxfp4_rows1), the same quantizers and the same fp32 operations in the same order whatever
   thread runs it: the same bits at any thread count. The projections and the experts are the per-layer path's
   kernels (CpuQuantLinear / GGUFLinear, mf_mxfp4_expert; the combine's k-order sum) bit for bit; the norms, the
   attention and the router differ from its torch ops in summation order only (tests/test_gpt_oss_step.py).

   mf_gptoss_decode_step runs the tail too, in the same region: the final norm and the lm_head (step_head.c's
   mf_head_team, which step_region.c's mf_decode_step runs as well: int8 / int4 native heads, a GGUF file's
   K-quant or Q8_0 head on its blocks, the refined int4 head), mf_head_calls' numbers bit for bit. */

#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "gguf.h"
#include "mxfp4.h"
#include "step.h"

typedef struct {  /* one attention projection y [n] = x W.T (+ b) */
    int bits;     /* 8 / 4: native.c's int8 / int4 rows (w, s, m; group, fmt as mf_linear); 0: GGUF blocks */
    int group, fmt, type;  /* type: the GGUF blocks' ggml type id (bits 0) */
    int64_t stride;        /* GGUF: bytes between rows */
    const void* w;
    const void* s;
    const void* m;
    const float* b;  /* fp32 bias [n], or NULL */
} mf_proj;

typedef struct {  /* one expert's region (mxfp4.c's layout) */
    const uint8_t *b13, *s13, *b2, *s2;  /* w13 [2I, H] blocks, scales; w2 [H, I] */
    const void *c13, *c2;                /* biases [2I], [H] of the layer's bias_kind, or NULL */
} mf_mx_expert;

typedef struct {  /* one gpt-oss decoder layer */
    const float *w_in, *w_post;  /* the norms' weights fp32 [H] */
    float eps;
    mf_proj pq, pk, pv, po;  /* q, k, v, o */
    int nh, nkv, D;
    const float* sinks;               /* fp32 [nh] */
    const float *gate, *gate_b;       /* router fp32 [E, H], bias [E] (or NULL) */
    int E, k, I, p13, p2, bias_kind, act;
    float alpha, limit;
    const mf_mx_expert* experts;      /* [E] */
} mf_gptoss_layer;

/* ---- projections ------------------------------------------------------------------------------------------- */

typedef struct {  /* one token's activations for a projection of up to K inputs, in the form its kernel takes */
    int8_t* q;
    float *s, *gsum;
    int32_t* sum;
    void* gg;  /* gguf.c's (mf_gguf_acts1) */
} pacts;

static size_t pacts_bytes(int K) {
    return mf_up64((size_t)K) + 3 * mf_up64(sizeof(float) * (size_t)(K / QB)) + mf_up64(mf_gguf_acts1_bytes(K));
}
static void pacts_take(pacts* a, char** p, int K) {
    a->q = mf_take(p, (size_t)K);
    a->s = mf_take(p, sizeof(float) * (size_t)(K / QB));
    a->gsum = mf_take(p, sizeof(float) * (size_t)(K / QB));
    a->sum = mf_take(p, sizeof(int32_t) * (size_t)(K / QB));
    a->gg = mf_take(p, mf_gguf_acts1_bytes(K));
}

/* x fp32 [K] as the projection's kernel quantizes it (mf_q8_linear's, mf_q4_linear's, mf_gguf_linear's). */
static void proj_quantize(const mf_proj* l, const float* x, int K, pacts* a) {
    if (l->bits == 0)
        mf_gguf_acts1(x, K, l->type, a->gg);
    else if (l->bits == 4)
        mf_quantize_row(x, K, l->group, a->q, a->s, a->gsum, a->sum);
    else
        mf_quantize_row(x, K, K, a->q, a->s, NULL, NULL);
}
static int same_acts(const mf_proj* a, const mf_proj* b) {
    return a->bits == b->bits && (a->bits != 4 || a->group == b->group) && (a->bits != 0 || a->type == b->type);
}

/* y [N] = the projection's rows (+ bias: one add per output, as the module's y += bias) shared out among the team
   in 16-row items (an orphaned worksharing loop without its barrier). */
static void proj_for(const mf_proj* l, int N, int K, const pacts* a, float* y) {
    const int nc = mf_nchunks(N);
#pragma omp for schedule(static) nowait
    for (int c = 0; c < nc; c++) {
        const int n0 = c * MF_ROWS, n1 = n0 + MF_ROWS < N ? n0 + MF_ROWS : N;
        if (l->bits == 0)
            mf_gguf_rows1(l->type, l->w, l->stride, n0, n1, K, a->gg, y);
        else if (l->bits == 4)
            mf_q4_rows(n0, n1, 1, K, l->group, l->fmt, l->w, l->s, l->m, a->q, a->s, a->gsum, a->sum, y, N);
        else
            mf_q8_rows(n0, n1, 1, K, l->w, l->s, a->q, a->s, y, N);
        if (l->b)
            for (int n = n0; n < n1; n++) y[n] += l->b[n];
    }
}

/* ---- attention ------------------------------------------------------------------------------------------------ */

/* One query head with a sink: q = rotary(qh [D]); o [D] = sum_l p_l v_l, p = softmax over (the visible scores
   q.k_l * scale, sink) without the sink's share; kh, vh fp32 [L, D]; buf: L + D floats. */
static void sink_head(const float* qh, const float* c, const float* s, int D, const uint8_t* mrow, const float* kh,
                      const float* vh, int L, float scale, float sink, float* buf, float* o) {
    L = mf_mask_extent(mrow, L);  /* (the masked positions after the last visible one: never read) */
    float *p = buf, *q = buf + L;
    mf_rotary(qh, c, s, D, q);
    float mx = sink;
    for (int l = 0; l < L; l++) {
        if (!mrow[l]) continue;
        p[l] = mf_dot(q, kh + (size_t)l * D, D) * scale;
        mx = mx > p[l] ? mx : p[l];
    }
    float den = expf(sink - mx);
    for (int l = 0; l < L; l++)
        if (mrow[l]) {
            p[l] = expf(p[l] - mx);
            den += p[l];
        }
    for (int j = 0; j < D; j++) o[j] = 0.0f;
    for (int l = 0; l < L; l++) {
        if (!mrow[l]) continue;
        const float w = p[l] / den;
        const float* vl = vh + (size_t)l * D;
        for (int j = 0; j < D; j++) o[j] += w * vl[j];
    }
}

/* The per-layer path's attention op for one token (gpt_oss_step.py's sink_attention_step; the step's own
   attention, the same calls): q fp32 [nh D], k, v fp32 [nkv D] (before the rotary) -> the rotated key and the
   value written at pos of kc, vc fp32 [nkv, L, D], out fp32 [nh D] (sink_head per query head; mask bool [L]).
   Returns 0, or -1 when out of memory. */
int mf_sink_attn_step(const float* q, const float* k, const float* v, int nh, int nkv, int D, const float* cos,
                      const float* sin, float* kc, float* vc, int L, int64_t pos, const uint8_t* mask, float scale,
                      const float* sinks, float* out, int nthreads) {
    const int groups = nh / nkv;
    for (int g = 0; g < nkv; g++) {
        const size_t at = ((size_t)g * L + (size_t)pos) * D;
        mf_rotary(k + (size_t)g * D, cos, sin, D, kc + at);
        memcpy(vc + at, v + (size_t)g * D, sizeof(float) * D);
    }
    const int nt = nthreads > 1 ? nthreads : 1;
    float* bufs = malloc(sizeof(float) * ((size_t)L + D) * nt);
    if (!bufs) return -1;
#pragma omp parallel for num_threads(nt) schedule(static)
    for (int h = 0; h < nh; h++)
        sink_head(q + (size_t)h * D, cos, sin, D, mask, kc + (size_t)(h / groups) * L * D,
                  vc + (size_t)(h / groups) * L * D, L, scale, sinks[h], bufs + ((size_t)L + D) * omp_get_thread_num(),
                  out + (size_t)h * D);
    free(bufs);
    return 0;
}

typedef struct {  /* the buffers the whole team reads and writes */
    float *q, *k, *v, *att, *y, *h13, *ye, *moe;  /* [nh D], [nkv D] x2, [nh D], [H], [k, 2I], [k, H], [H] */
} team_bufs;

typedef struct {  /* one thread's own buffers */
    float *x, *xa, *hn, *hm, *abuf, *logits, *wts, *act;
    int32_t* ids;
    pacts in[4];  /* q's, k's, v's and o's inputs */
    mxacts ax;    /* the experts' input */
    mxacts* aa;   /* [k]: each expert's activation */
} own_bufs;

typedef struct { int F, D, I, E, k, K; } dims;  /* the largest sizes over the layers (F: nh D) */

static size_t mx_bytes(int K) {
    const size_t nbp = (size_t)(K / 32 + 1) / 2;
    return mf_up64(nbp * 64) + mf_up64(32 * nbp);
}
static void mx_take(mxacts* a, char** p, int K) {
    a->nbp = (K / 32 + 1) / 2;
    a->q = mf_take(p, (size_t)a->nbp * 64);
    a->s = mf_take(p, sizeof(float) * 8 * (size_t)a->nbp);
}
static size_t own_bytes(const dims* m, int H, int L) {
    return 4 * mf_up64(sizeof(float) * H) + mf_up64(sizeof(float) * ((size_t)L + m->D)) +
           mf_up64(sizeof(float) * m->E) + mf_up64(sizeof(float) * m->k) + mf_up64(sizeof(int32_t) * m->k) +
           mf_up64(sizeof(float) * m->I) +
           4 * pacts_bytes(m->K) + mx_bytes(H) + mf_up64(sizeof(mxacts) * m->k) + (size_t)m->k * mx_bytes(m->I);
}
static void own_take(own_bufs* o, char* p, const dims* m, int H, int L) {
    float** hs[] = {&o->x, &o->xa, &o->hn, &o->hm};
    for (int i = 0; i < 4; i++) *hs[i] = mf_take(&p, sizeof(float) * H);
    o->abuf = mf_take(&p, sizeof(float) * ((size_t)L + m->D));
    o->logits = mf_take(&p, sizeof(float) * m->E);
    o->wts = mf_take(&p, sizeof(float) * m->k);
    o->ids = mf_take(&p, sizeof(int32_t) * m->k);
    o->act = mf_take(&p, sizeof(float) * m->I);
    for (int i = 0; i < 4; i++) pacts_take(&o->in[i], &p, m->K);
    mx_take(&o->ax, &p, H);
    o->aa = mf_take(&p, sizeof(mxacts) * m->k);
    for (int j = 0; j < m->k; j++) mx_take(&o->aa[j], &p, m->I);
}

/* The attention half, run by every thread of the team: x -> xa = x + attention, hm = rmsnorm(xa) (own buffers). */
static void attention_half(const mf_gptoss_layer* d, int H, const float* cos, const float* sin, float* kc, float* vc,
                           int L, int64_t pos, const uint8_t* mask, float scale, team_bufs* S, own_bufs* P) {
    const int nh = d->nh, nkv = d->nkv, D = d->D, groups = nh / nkv;
    mf_rmsnorm(P->x, NULL, NULL, d->w_in, d->eps, 1, H, P->hn);
    const mf_proj* pr[3] = {&d->pq, &d->pk, &d->pv};
    const pacts* in[3];
    for (int i = 0; i < 3; i++) {  /* each projection's activations (quantized once per form) */
        in[i] = &P->in[i];
        for (int j = 0; j < i; j++)
            if (same_acts(pr[i], pr[j])) { in[i] = in[j]; break; }
        if (in[i] == &P->in[i]) proj_quantize(pr[i], P->hn, H, &P->in[i]);
    }
    proj_for(&d->pq, nh * D, H, in[0], S->q);
    proj_for(&d->pk, nkv * D, H, in[1], S->k);
    proj_for(&d->pv, nkv * D, H, in[2], S->v);
#pragma omp barrier
#pragma omp for schedule(static)
    for (int g = 0; g < nkv; g++) {  /* the cache rows (rotated keys) */
        const size_t at = ((size_t)g * L + (size_t)pos) * D;
        mf_rotary(S->k + (size_t)g * D, cos, sin, D, kc + at);
        memcpy(vc + at, S->v + (size_t)g * D, sizeof(float) * D);
    }
#pragma omp for schedule(static)
    for (int h = 0; h < nh; h++)
        sink_head(S->q + (size_t)h * D, cos, sin, D, mask, kc + (size_t)(h / groups) * L * D,
                  vc + (size_t)(h / groups) * L * D, L, scale, d->sinks[h], P->abuf, S->att + (size_t)h * D);
    proj_quantize(&d->po, S->att, nh * D, &P->in[3]);
    proj_for(&d->po, H, nh * D, &P->in[3], S->y);
#pragma omp barrier
    mf_rmsnorm(P->x, S->y, P->xa, d->w_post, d->eps, 1, H, P->hm);
}

/* gpt-oss's routing of one token: ids [k] the k largest logits [E] (largest first, the lower index first among
   equals), w [k] their softmax (max subtracted, expf, summed in k order, divided). */
static void topk_softmax(const float* logits, int E, int k, int32_t* ids, float* w) {
    for (int j = 0; j < k; j++) {
        int best = -1;
        for (int e = 0; e < E; e++) {
            int taken = 0;
            for (int i = 0; i < j; i++) taken |= ids[i] == e;
            if (!taken && (best < 0 || logits[e] > logits[best])) best = e;
        }
        ids[j] = best;
    }
    const float mx = logits[ids[0]];
    float sum = 0.0f;
    for (int j = 0; j < k; j++) {
        w[j] = expf(logits[ids[j]] - mx);
        sum += w[j];
    }
    for (int j = 0; j < k; j++) w[j] /= sum;
}

/* The per-layer path's router op (gpt_oss_step.py's topk_softmax): logits fp32 [T, E] -> ids int32 [T, k],
   weights fp32 [T, k], each token as the one-call step routes it. */
void mf_topk_softmax(const float* logits, int T, int E, int k, int32_t* ids, float* weights) {
    for (int t = 0; t < T; t++)
        topk_softmax(logits + (size_t)t * E, E, k, ids + (size_t)t * k, weights + (size_t)t * k);
}

/* The biased router (every thread, own buffers): logits = hm G.T + g (the per-layer path's router_logits and its
   one add per logit), then topk_softmax. */
static void route(const mf_gptoss_layer* d, int H, own_bufs* P) {
    mf_dense_f32(P->hm, 1, H, d->E, d->gate, P->logits);
    if (d->gate_b)
        for (int e = 0; e < d->E; e++) P->logits[e] += d->gate_b[e];
    topk_softmax(P->logits, d->E, d->k, P->ids, P->wts);
}

/* The MoE half, run by every thread of the team: hm -> x = xa + the k experts' weighted outputs (own buffers). */
static void moe_half(const mf_gptoss_layer* d, int H, team_bufs* S, own_bufs* P, int tid, int nth, int32_t* ids,
                     float* weights) {
    const int k = d->k, I = d->I;
    route(d, H, P);
    if (tid == 0) {
        memcpy(ids, P->ids, sizeof(int32_t) * k);
        memcpy(weights, P->wts, sizeof(float) * k);
    }
    mx_acts_row(&P->ax, P->hm, H, 0);
    if (k % nth == 0) {  /* whole experts per thread (one thread: all of them, in k order): no barrier inside one */
        for (int j = tid; j < k; j += nth) {
            const mf_mx_expert* e = &d->experts[P->ids[j]];
            float *h = S->h13 + (size_t)j * 2 * I, *y = S->ye + (size_t)j * H;
            mf_mxfp4_rows1(e->b13, e->s13, 2 * I, H, d->p13, 0, 2 * I, &P->ax, h);
            mx_gate_up(h, P->act, I, e->c13, d->bias_kind, d->act, d->alpha, d->limit);
            mx_acts_row(&P->aa[0], P->act, I, 0);
            mf_mxfp4_rows1(e->b2, e->s2, H, I, d->p2, 0, H, &P->aa[0], y);
            mx_down_out(y, 1, H, 0, H, e->c2, d->bias_kind, &P->wts[j], y, 0);
        }
#pragma omp barrier
        for (int n = 0; n < H; n++) {  /* the combine's k-order sum, then the residual add */
            float m = S->ye[n];
            for (int j = 1; j < k; j++) m = m + S->ye[(size_t)j * H + n];
            P->x[n] = P->xa[n] + m;
        }
        return;
    }
    int r0, r1;  /* this thread's gate/up rows of every expert: one long range (mxfp4.c reads long runs per panel) */
    mf_span(2 * I, tid, nth, &r0, &r1);
    for (int j = 0; j < k; j++) {
        const mf_mx_expert* e = &d->experts[P->ids[j]];
        mf_mxfp4_rows1(e->b13, e->s13, 2 * I, H, d->p13, r0, r1, &P->ax, S->h13 + (size_t)j * 2 * I);
    }
#pragma omp barrier
    for (int j = 0; j < k; j++) {  /* every thread: the activations (mf_mxfp4_expert's epilogue) */
        mx_gate_up(S->h13 + (size_t)j * 2 * I, P->act, I, d->experts[P->ids[j]].c13, d->bias_kind, d->act, d->alpha,
                   d->limit);
        mx_acts_row(&P->aa[j], P->act, I, 0);
    }
    int n0, n1;  /* this thread's rows of every down matrix, then their sum in k order (the combine's) */
    mf_span(H, tid, nth, &n0, &n1);
    for (int j = 0; j < k; j++) {
        const mf_mx_expert* e = &d->experts[P->ids[j]];
        float* y = S->ye + (size_t)j * H;
        mf_mxfp4_rows1(e->b2, e->s2, H, I, d->p2, n0, n1, &P->aa[j], y);
        mx_down_out(y, 1, H, n0, n1, e->c2, d->bias_kind, &P->wts[j], y, 0);  /* (y + b2) * w_j, in place */
        for (int n = n0; n < n1; n++) S->moe[n] = j ? S->moe[n] + y[n] : y[n];
    }
#pragma omp barrier
    for (int n = 0; n < H; n++) P->x[n] = P->xa[n] + S->moe[n];
}

/* One token x fp32 [H] through n gpt-oss layers, in place (mf_gptoss_step); then, when head is not NULL, in the
   same region the tail (step_head.c's mf_head_team): logits fp32 [head->head.n] (mf_gptoss_decode_step). */
static int gptoss_region(const mf_gptoss_layer* layers, int n, float* x, int H, const float* cos, const float* sin,
                         void* const* kv, int L, const int64_t* pos, float scale, int32_t* ids, float* weights,
                         const mf_head_desc* head, float* logits, int nthreads) {
    dims m = {1, 1, 1, 1, 1, H};
    for (int l = 0; l < n; l++) {
        const mf_gptoss_layer* d = &layers[l];
        if (H % 32 || d->I % 32 || d->nkv <= 0 || d->nh % d->nkv || d->D % 2 || d->k < 1 || d->k > d->E ||
            (d->p13 != 32 && d->p13 != 64) || (d->p2 != 32 && d->p2 != 64) || H % d->p13 || d->I % d->p2)
            return -2;
        const int v[5] = {d->nh * d->D, d->D, d->I, d->E, d->k};
        int* mv[5] = {&m.F, &m.D, &m.I, &m.E, &m.k};
        for (int i = 0; i < 5; i++) *mv[i] = v[i] > *mv[i] ? v[i] : *mv[i];
    }
    if (n <= 0) return head ? mf_head_calls(head, x, H, logits, nthreads) : 0;
    m.K = m.F > H ? m.F : H;
    const int nt = nthreads > 1 ? nthreads : 1;
    const size_t team = 4 * mf_up64(sizeof(float) * m.F) + 2 * mf_up64(sizeof(float) * H) +
                        mf_up64(sizeof(float) * m.k * 2 * (size_t)m.I) + mf_up64(sizeof(float) * m.k * (size_t)H);
    const size_t own = own_bytes(&m, H, L), tail = head ? mf_head_team_bytes(H) : 0;
    char* mem = aligned_alloc(64, team + nt * (own + tail));
    if (!mem) return -1;
    char* p = mem;
    team_bufs S;
    S.q = mf_take(&p, sizeof(float) * m.F);
    S.k = mf_take(&p, sizeof(float) * m.F);
    S.v = mf_take(&p, sizeof(float) * m.F);
    S.att = mf_take(&p, sizeof(float) * m.F);
    S.y = mf_take(&p, sizeof(float) * H);
    S.moe = mf_take(&p, sizeof(float) * H);
    S.h13 = mf_take(&p, sizeof(float) * m.k * 2 * (size_t)m.I);
    S.ye = mf_take(&p, sizeof(float) * m.k * (size_t)H);
#pragma omp parallel num_threads(nt)
    {
        const int tid = omp_get_thread_num(), nth = omp_get_num_threads();
        own_bufs P;
        own_take(&P, mem + team + (size_t)tid * own, &m, H, L);
        memcpy(P.x, x, sizeof(float) * H);
        for (int l = 0; l < n; l++) {
            const mf_gptoss_layer* d = &layers[l];
            attention_half(d, H, cos, sin, (float*)kv[3 * l], (float*)kv[3 * l + 1], L, pos[0],
                           (const uint8_t*)kv[3 * l + 2], scale, &S, &P);
            moe_half(d, H, &S, &P, tid, nth, ids + (size_t)l * d->k, weights + (size_t)l * d->k);
        }
        if (tid == 0) memcpy(x, P.x, sizeof(float) * H);
        if (head) mf_head_team(head, P.x, H, logits, mem + team + nt * own + (size_t)tid * tail);
    }
    free(mem);
    return 0;
}

/* One token x fp32 [H] through n gpt-oss layers, in place. cos, sin fp32 [D]; kv: per layer (k cache, v cache fp32
   [nkv, L, D], mask bool [L]: the positions the layer's query sees, its sliding window included), written at
   pos[0]; scale: the scores' factor; ids int32 [n, k], weights fp32 [n, k]: each layer's routing. Returns 0, -1
   out of memory, -2 bad arguments (sizes the kernels do not take). */
int mf_gptoss_step(const mf_gptoss_layer* layers, int n, float* x, int H, const float* cos, const float* sin,
                   void* const* kv, int L, const int64_t* pos, float scale, int32_t* ids, float* weights,
                   int nthreads) {
    return gptoss_region(layers, n, x, H, cos, sin, kv, L, pos, scale, ids, weights, NULL, NULL, nthreads);
}

/* mf_gptoss_step, then in the same parallel region the final norm and the lm_head of the token (step.h's
   mf_head_desc): logits fp32 [head->head.n], mf_head_calls' numbers bit for bit. Returns as mf_gptoss_step; -2
   also for a head the tail does not take (mf_head_check). */
int mf_gptoss_decode_step(const mf_gptoss_layer* layers, int n, float* x, int H, const float* cos, const float* sin,
                          void* const* kv, int L, const int64_t* pos, float scale, int32_t* ids, float* weights,
                          const mf_head_desc* head, float* logits, int nthreads) {
    if (mf_head_check(head, H)) return -2;
    return gptoss_region(layers, n, x, H, cos, sin, kv, L, pos, scale, ids, weights, head, logits, nthreads);
}
