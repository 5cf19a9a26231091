/* ---- a greedy multi-token decode loop around the one-call step (issue 42) ----

   mf_decode_loop: up to n tokens of batch-1 greedy decoding without returning to Python between them. Per token it
   does what the per-token path does from Python (engine/generate.py's loop, Runner.forward_pass,
   CausalDecoder.forward, NativeLayers.logits / NativeGptOssLayers.logits, sampling.next_tokens), in the same order
   and with the same numbers:

   * the embedding: the last token's row of the fp32 table (nn.Embedding's lookup: a copy of the row), or of a GGUF
     file's K-quant table used as stored (embed_type its ggml type id: engine/stored_embedding.py's lookup,
     gguf.c's mf_gguf_dequant_rows, the same call);
   * the rotary cos / sin: row i of tables the caller computed with the decoder's own rotary module for the
     positions the call covers (the same bits as the per-token path's);
   * the masks: cache.mark_valid (valid[q] = 1 for the real token at cache position q), then kv_cache.py's
     attention_mask for each window the layers use (valid from max(q - w + 1, 0), or 0 for full attention, to q;
     q itself always; nothing after q), each into its row of `masks`, which the layers' kv entries point at;
   * the step itself: mf_decode_step (kind 0, step_region.c: every layer of a Mixtral-layout decoder, the final
     norm and the lm_head in one region) or mf_gptoss_decode_step (kind 1, step_gptoss.c: gpt-oss's);
   * the next token: the first index of the largest logit, a NaN the largest (numpy's argmax, as next_tokens).

   It stops after n tokens or after a token in eos[0 .. n_eos). */

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "gguf.h"  /* mf_gguf_dequant_rows */
#include "step.h"

/* step_gptoss.c's (its layer type is private to it: the descriptors pass through as they came from Python) */
int mf_gptoss_decode_step(const void* layers, int n, float* x, int H, const float* cos, const float* sin,
                          void* const* kv, int L, const int64_t* pos, float scale, int32_t* ids, float* weights,
                          const mf_head_desc* head, float* logits, int nthreads);

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

/* kind 0: layers mf_layer_desc [nl], 1: gpt-oss's [nl]; H, kv (3 per layer: k cache, v cache, the layer's mask
   row), L, scale, head and nthreads: the step's. kmax: the layers' largest top-k. embed: fp32 [n_embed, H]
   (embed_type 0), or n_embed rows of ggml type embed_type, embed_stride bytes apart (a K-quant type); cos / sin
   fp32 [n, D] (row i: step i's position); masks uint8 [n_masks, L] (scratch the kv entries point into), windows
   int64 [n_masks] (each row's sliding window, -1: full attention); valid uint8 [L] (the cache's row, written); the
   first step's input token tok0 at cache position q0. logits fp32 [V] (keep_all: [n, V], every step's). Output:
   tokens int64 [n], times fp64 [n + 1] (CLOCK_MONOTONIC seconds: the call's start, then each token's end).
   Returns how many tokens were decoded (1 .. n), or the step's error code (-1 out of memory, -2 refused), -3 for a
   token outside the embedding table or a position past the cache. */
int mf_decode_loop(int kind, const void* layers, int nl, int kmax, int H, const void* embed, int64_t n_embed,
                   int embed_type, int64_t embed_stride, const float* cos, const float* sin, int D, void* const* kv,
                   uint8_t* masks, const int64_t* windows, int n_masks, uint8_t* valid, int L, int64_t q0,
                   int64_t tok0, float scale, const mf_head_desc* head, float* logits, int keep_all,
                   const int64_t* eos, int n_eos, int n, int64_t* tokens, double* times, int nthreads) {
    times[0] = now_s();
    if (n <= 0) return 0;
    const size_t nk = (size_t)(nl > 0 ? nl : 1) * (size_t)(kmax > 0 ? kmax : 1);
    float* x = malloc(sizeof(float) * (size_t)H);
    int32_t* ids = malloc(sizeof(int32_t) * nk);
    float* weights = malloc(sizeof(float) * nk);
    int rc = 0, done = 0;
    if (!x || !ids || !weights) rc = -1;
    const int V = head->head.n;
    for (int i = 0; i < n && !rc; i++) {
        const int64_t tok = i ? tokens[i - 1] : tok0, q = q0 + i;
        if (tok < 0 || tok >= n_embed || q < 0 || q >= L) { rc = -3; break; }
        if (embed_type) {
            rc = mf_gguf_dequant_rows(embed_type, (const uint8_t*)embed + tok * embed_stride, 1, H, embed_stride, x);
            if (rc) break;
        } else {
            memcpy(x, (const float*)embed + tok * (int64_t)H, sizeof(float) * (size_t)H);
        }
        valid[q] = 1;
        for (int m = 0; m < n_masks; m++) {
            uint8_t* mask = masks + (size_t)m * L;
            const int64_t lo = windows[m] < 0 || q - windows[m] + 1 < 0 ? 0 : q - windows[m] + 1;
            for (int j = 0; j < L; j++) mask[j] = j >= lo && j <= q ? valid[j] : 0;
            mask[q] = 1;
        }
        float* out = keep_all ? logits + (size_t)i * V : logits;
        const float* c = cos + (size_t)i * D, *s = sin + (size_t)i * D;
        rc = kind ? mf_gptoss_decode_step(layers, nl, x, H, c, s, kv, L, &q, scale, ids, weights, head, out, nthreads)
                  : mf_decode_step(layers, nl, x, H, c, s, kv, L, &q, scale, ids, weights, head, out, nthreads);
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
