/* ---- a greedy multi-token decode loop around the one-call step (issue 42) ----

   mf_decode_loop: up to n tokens of batch-1 greedy decoding without returning to Python between them. Per token it
   does what the per-token path does from Python (engine/generate.py's loop, Runner.forward_pass,
   CausalDecoder.forward, NativeLayers.logits, sampling.next_tokens), in the same order and with the same numbers:

   * the embedding: the last token's row of the fp32 table (nn.Embedding's lookup: a copy of the row);
   * the rotary cos / sin: row i of tables the caller computed with the decoder's own RotaryEmbedding for the
     positions the call covers (the same bits as the per-token path's);
   * the mask: cache.mark_valid (valid[q] = 1 for the real token at cache position q), then attention_mask's rows
     for a full-attention layer (valid at and before q, q itself always, nothing after q) into `mask`, which every
     layer's kv entry points at (the caller refuses sliding windows);
   * the step itself: mf_decode_step (step_region.c: every layer, the final norm and the lm_head in one region);
   * the next token: the first index of the largest logit, a NaN the largest (numpy's argmax, as next_tokens).

   It stops after n tokens or after a token in eos[0 .. n_eos). */

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "step.h"

static double now_s(void) {  /* CLOCK_MONOTONIC: Python's time.monotonic / perf_counter on Linux */
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

/* numpy's argmax of a float row: the first largest value; the first NaN when there is one. */
static int64_t argmax_first(const float* v, int n) {
    int64_t best = 0;
    float bv = v[0];
    if (isnan(bv)) return 0;
    for (int i = 1; i < n; i++) {
        if (isnan(v[i])) return i;
        if (v[i] > bv) { bv = v[i]; best = i; }
    }
    return best;
}

/* layers [nl], H, kv (3 per layer: k cache, v cache, mask pointer, the masks all `mask`), L, scale, head and
   nthreads: mf_decode_step's. embed fp32 [n_embed, H]; cos / sin fp32 [n, D] (row i: the token at position
   pos0's row + i); valid uint8 [L] (the cache's row, written); mask uint8 [L] (scratch the kv entries point at);
   the first step's input token tok0 at cache position q0. logits fp32 [V] (keep_all: [n, V], every step's).
   Output: tokens int64 [n], times fp64 [n + 1] (CLOCK_MONOTONIC seconds: the call's start, then each token's end).
   Returns how many tokens were decoded (1 .. n), or mf_decode_step's error code (-1 out of memory, -2 refused),
   -3 for a token outside the embedding table or a position past the cache. */
int mf_decode_loop(const mf_layer_desc* layers, int nl, int H, const float* embed, int64_t n_embed, const float* cos,
                   const float* sin, int D, void* const* kv, uint8_t* mask, uint8_t* valid, int L, int64_t q0,
                   int64_t tok0, float scale, const mf_head_desc* head, float* logits, int keep_all,
                   const int64_t* eos, int n_eos, int n, int64_t* tokens, double* times, int nthreads) {
    times[0] = now_s();
    if (n <= 0) return 0;
    int kmax = 1;
    for (int l = 0; l < nl; l++) kmax = layers[l].k > kmax ? layers[l].k : kmax;
    float* x = malloc(sizeof(float) * (size_t)H);
    int32_t* ids = malloc(sizeof(int32_t) * (size_t)(nl > 0 ? nl : 1) * kmax);
    float* weights = malloc(sizeof(float) * (size_t)(nl > 0 ? nl : 1) * kmax);
    int rc = 0, done = 0;
    if (!x || !ids || !weights) rc = -1;
    const int V = head->head.n;
    for (int i = 0; i < n && !rc; i++) {
        const int64_t tok = i ? tokens[i - 1] : tok0, q = q0 + i;
        if (tok < 0 || tok >= n_embed || q < 0 || q >= L) { rc = -3; break; }
        memcpy(x, embed + tok * (int64_t)H, sizeof(float) * (size_t)H);
        valid[q] = 1;
        for (int j = 0; j < L; j++) mask[j] = j <= q ? valid[j] : 0;
        mask[q] = 1;
        float* out = keep_all ? logits + (size_t)i * V : logits;
        rc = mf_decode_step(layers, nl, x, H, cos + (size_t)i * D, sin + (size_t)i * D, kv, L, &q, scale, ids,
                            weights, head, out, nthreads);
        if (rc) break;
        tokens[i] = argmax_first(out, V);
        times[i + 1] = now_s();
        done = i + 1;
        int stop = 0;
        for (int e = 0; e < n_eos; e++) stop |= tokens[i] == eos[e];
        if (stop) break;
    }
    free(x);
    free(ids);
    free(weights);
    return rc ? rc : done;
}
