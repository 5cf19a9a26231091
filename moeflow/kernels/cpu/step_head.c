/* The tail of a one-token decode step: the final RMSNorm and the lm_head as the per-layer path calls them (step.c's
   mf_rmsnorm, native.c's mf_q8_linear / mf_q4_linear, gguf.c's mf_gguf_linear, the refined int4 head's int8
   candidates). mf_head_calls runs it outside a parallel region (after mf_layers_step_calls, or with no layers);
   mf_head_team runs the same numbers inside the one region of a one-call step (step_region.c's mf_decode_step,
   step_gptoss.c's mf_gptoss_decode_step), the rows shared out by the team. */

#include <omp.h>
#include <stdlib.h>

#include "gguf.h"  /* mf_gguf_linear, mf_gguf_supported, GG_Q8_0 */
#include "step.h"

/* 0 when the tail takes this head for hidden size H, else -2. */
int mf_head_check(const mf_head_desc* head, int H) {
    if (head->candidates && (head->candidates > MF_MAX_CANDIDATES || head->candidates > head->head.n ||
                             head->head.bits != 4 || head->exact.bits != 8 || head->exact.n != head->head.n))
        return -2;
    if (head->gguf_type) return mf_gguf_supported(head->gguf_type, H, GG_Q8_0, QB);
    return head->head.bits == 8 || (head->head.bits == 4 && head->head.group > 0 && H % head->head.group == 0) ? 0 : -2;
}

int mf_head_calls(const mf_head_desc* head, const float* x, int H, float* logits, int nthreads) {
    if (mf_head_check(head, H)) return -2;
    float* h = malloc(sizeof(float) * (size_t)H);
    if (!h) return -1;
    mf_rmsnorm(x, NULL, NULL, head->norm, head->eps, 1, H, h);
    const mf_linear* l = &head->head;
    int rc = head->gguf_type ? mf_gguf_linear(h, 1, H, l->n, head->gguf_type, (const uint8_t*)l->w, head->stride,
                                                    logits, nthreads)
                 : l->bits == 8 ? mf_q8_linear(h, 1, H, l->n, (const int8_t*)l->w, (const float*)l->s, logits,
                                               nthreads)
                                : mf_q4_linear(h, 1, H, l->n, l->group, l->fmt, (const uint8_t*)l->w, l->s, l->m,
                                               logits, nthreads);
    if (!rc && head->candidates) rc = mf_head_refine(head, h, H, logits, NULL, NULL);
    free(h);
    return rc;
}

/* The refined int4 head's second half (lm_head.py's RefinedInt4LmHead at one token): the `candidates` largest of
   logits [V] (the int4 head's; ties to the lower index), recomputed from the int8 rows against x fp32 [H] (the
   final norm's output) quantized to int8 per 32 (mf_q8_linear_rows' numbers) and written in their place. xq
   [H] and xs [H/32]: scratch (NULL: allocated here). Returns 0, or -1 when out of memory. */
int mf_head_refine(const mf_head_desc* head, const float* x, int H, float* logits, int8_t* xq, float* xs) {
    const int V = head->head.n, c = head->candidates;
    int own = 0;
    if (!xq || !xs) {
        xq = malloc((size_t)H);
        xs = malloc(sizeof(float) * (size_t)(H / QB));
        own = 1;
        if (!xq || !xs) { free(xq); free(xs); return -1; }
    }
    int ids[MF_MAX_CANDIDATES];
    float best[MF_MAX_CANDIDATES];  /* descending; a value enters only when larger than the smallest kept */
    int m = 0;
    for (int v = 0; v < V; v++) {
        const float y = logits[v];
        if (m == c && !(y > best[c - 1])) continue;
        int i = m < c ? m++ : c - 1;
        while (i > 0 && y > best[i - 1]) { best[i] = best[i - 1]; ids[i] = ids[i - 1]; i--; }
        best[i] = y;
        ids[i] = v;
    }
    mf_quantize_row(x, H, H, xq, xs, NULL, NULL);
    const mf_linear* e = &head->exact;
    for (int i = 0; i < m; i++)
        mf_q8_row(ids[i], V, 1, H, (const int8_t*)e->w, (const float*)e->s, xq, xs, logits + ids[i], 1);
    if (own) { free(xq); free(xs); }
    return 0;
}

size_t mf_head_team_bytes(int H) {
    return mf_up64(sizeof(float) * (size_t)H) + mf_up64((size_t)H) + 2 * mf_up64(sizeof(float) * (size_t)(H / QB)) +
           mf_up64(sizeof(int32_t) * (size_t)(H / QB)) + mf_up64(mf_gguf_acts1_bytes(H));
}

void mf_head_team(const mf_head_desc* head, const float* x, int H, float* logits, void* scratch) {
    char* p = scratch;
    float* h = mf_take(&p, sizeof(float) * (size_t)H);
    int8_t* q = mf_take(&p, (size_t)H);
    float* s = mf_take(&p, sizeof(float) * (size_t)(H / QB));
    float* gsum = mf_take(&p, sizeof(float) * (size_t)(H / QB));
    int32_t* sum = mf_take(&p, sizeof(int32_t) * (size_t)(H / QB));
    void* gg = mf_take(&p, mf_gguf_acts1_bytes(H));
    mf_rmsnorm(x, NULL, NULL, head->norm, head->eps, 1, H, h);  /* every thread, into its own h */
    const mf_linear* l = &head->head;
    if (head->gguf_type) {
        mf_gguf_linear_team(h, H, l->n, head->gguf_type, (const uint8_t*)l->w, head->stride, logits, gg);
    } else {  /* the activations as mf_q4_linear (with its group's sums) / mf_q8_linear quantize them */
        if (l->bits == 4)
            mf_quantize_row(h, H, l->group, q, s, gsum, sum);
        else
            mf_quantize_row(h, H, H, q, s, NULL, NULL);
        const int nc = mf_nchunks(l->n);
#pragma omp for schedule(static) nowait
        for (int c = 0; c < nc; c++) {
            const int n0 = c * MF_ROWS, n1 = n0 + MF_ROWS < l->n ? n0 + MF_ROWS : l->n;
            if (l->bits == 4)
                mf_q4_rows(n0, n1, 1, H, l->group, l->fmt, (const uint8_t*)l->w, l->s, l->m, q, s, gsum, sum, logits,
                           l->n);
            else
                mf_q8_rows(n0, n1, 1, H, (const int8_t*)l->w, (const float*)l->s, q, s, logits, l->n);
        }
    }
    if (head->candidates) {  /* the refined int4 head: its candidates recomputed in int8 by one thread */
#pragma omp barrier
        if (omp_get_thread_num() == 0) mf_head_refine(head, h, H, logits, q, s);
    }
}
