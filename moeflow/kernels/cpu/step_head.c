/* The tail of a one-token decode step outside a parallel region (step.h's mf_head_calls): the final RMSNorm and the
   lm_head as the per-layer path calls them (step.c's mf_rmsnorm, native.c's mf_q8_linear / mf_q4_linear), for the
   layers mf_layers_step runs as separate calls (mf_layers_step_calls). mf_decode_step runs the same numbers
   inside its one region (step_region.c). */

#include <stdlib.h>

#include "gguf.h"  /* mf_gguf_linear, mf_gguf_supported, GG_Q8_0 */
#include "step.h"

/* 0 when the tail takes this head for hidden size H, else -2. */
int mf_head_check(const mf_head_desc* head, int H) {
    if (head->gguf_type) return mf_gguf_supported(head->gguf_type, H, GG_Q8_0, QB);
    return head->head.bits == 8 || (head->head.bits == 4 && head->head.group > 0 && H % head->head.group == 0) ? 0 : -2;
}

int mf_head_calls(const mf_head_desc* head, const float* x, int H, float* logits, int nthreads) {
    if (mf_head_check(head, H)) return -2;
    float* h = malloc(sizeof(float) * (size_t)H);
    if (!h) return -1;
    mf_rmsnorm(x, NULL, NULL, head->norm, head->eps, 1, H, h);
    const mf_linear* l = &head->head;
    const int rc = head->gguf_type ? mf_gguf_linear(h, 1, H, l->n, head->gguf_type, (const uint8_t*)l->w, head->stride,
                                                    logits, nthreads)
                 : l->bits == 8 ? mf_q8_linear(h, 1, H, l->n, (const int8_t*)l->w, (const float*)l->s, logits,
                                               nthreads)
                                : mf_q4_linear(h, 1, H, l->n, l->group, l->fmt, (const uint8_t*)l->w, l->s, l->m,
                                               logits, nthreads);
    free(h);
    return rc;
}
