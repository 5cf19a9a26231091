/* The decode-step declarations shared by step.c (the per-call ops, mf_layers_step_calls) and step_region.c
   (mf_layers_step: every layer of a one-token step in one OpenMP parallel region). */
#ifndef MOEFLOW_CPU_STEP_H
#define MOEFLOW_CPU_STEP_H
#include <stddef.h>
#include <stdint.h>

#include "native.h"

/* A quantized linear layer of the attention block: int4 (bits 4: packed, s, m, group, fmt: MF_Q4_F32 or
   MF_Q4_F16Z or MF_Q4_F16Z8), int8 (bits 8: packed holds the int8 weight, s its row scales) or a GGUF file's blocks
   (bits MF_LINEAR_GGUF: w the rows of blocks, fmt their ggml type id, group the row stride in bytes; gguf.c's
   mf_gguf_linear / mf_gguf_acts1 + mf_gguf_rows1, the same numbers). */
#define MF_LINEAR_GGUF 64
typedef struct {
    int bits, group, fmt, n;
    const void* w;
    const void* s;
    const void* m;
} mf_linear;

/* One expert: t13 == 0: q4 matrices w13 [2I, H] (gate then up), w2 [H, I] (q4.c's layout; s, m, fmt); t13 != 0:
   GGUF blocks as the file stores them (gguf.c): gate (w13) and up [I, H] of ggml type t13, rows s13 bytes apart,
   down (w2) [H, I] of type t2, rows s2 bytes apart (a Q4_K_M layer: Q4_K gate/up beside Q6_K or Q4_K down). */
typedef struct {
    const uint8_t* w13;
    const void* s13;
    const void* m13;
    const uint8_t* w2;
    const void* s2;
    const void* m2;
    int fmt;  /* MF_Q4_F32, MF_Q4_F16Z or MF_Q4_F16Z8, both matrices */
    int t13, t2;  /* GGUF: ggml type ids (GG_Q8_0, GG_Q4_K, ...); 0: q4 */
    int64_t gs13, gs2;  /* GGUF: row strides in bytes */
    const uint8_t* up;  /* GGUF: the up matrix */
} mf_expert_desc;

/* A Mixtral-layout decoder layer (or Qwen3-MoE's, OLMoE's: with a QK-norm): the attention half of mf_attn_block,
   a plain softmax-top-k router (fp32 gate [E, H]) and E SwiGLU experts (q4 or GGUF, mf_expert_desc) of
   intermediate size I. */
typedef struct {
    const float* w_in;
    const float* w_post;
    float eps;
    int qkv_bits, qkv_group, qkv_fmt;
    const void* qkv_w;
    const void* qkv_s;
    const void* qkv_m;
    int kv_bits, kv_group, kv_fmt;  /* kv_bits 0: qkv is all of q, k, v (mf_attn_block) */
    const void* kv_w;
    const void* kv_s;
    const void* kv_m;
    int o_bits, o_group, o_fmt;
    const void* o_w;
    const void* o_s;
    const void* o_m;
    int nh, nkv, D;
    const float* qkv_b;  /* the q/k/v bias fp32 [(nh + 2 nkv) D], or NULL */
    int qk;  /* QK-norm (mf_attn_step): MF_QK_NONE, MF_QK_HEAD (qn, kn [D]) or MF_QK_PROJ (qn [nh D], kn [nkv D]) */
    const float* qn;
    const float* kn;
    float qk_eps;
    const float* gate;
    int E, k, renorm, I, group;
    const mf_expert_desc* experts;
    const mf_expert_desc* shared;  /* a q4 shared expert (mf_shared_expert; t13 0), or NULL */
    const float* shared_gate;      /* its sigmoid output gate fp32 [H], or NULL */
    int shared_I, shared_group;
} mf_layer_desc;

/* The one-call steps' carving of their buffers and sharing of rows (step_region.c, step_gptoss.c, step_head.c). */
static inline size_t mf_up64(size_t n) { return (n + 63) & ~(size_t)63; }
static inline void* mf_take(char** p, size_t bytes) {  /* the next 64-byte aligned piece of a block */
    void* r = *p;
    *p += mf_up64(bytes);
    return r;
}
static inline int mf_nchunks(int N) { return (N + MF_ROWS - 1) / MF_ROWS; }
/* Thread tid's share [n0, n1) of N rows: a contiguous run of 16-row items, as a static schedule deals them. */
static inline void mf_span(int N, int tid, int nth, int* n0, int* n1) {
    const int nc = mf_nchunks(N), c0 = (int)((int64_t)nc * tid / nth), c1 = (int)((int64_t)nc * (tid + 1) / nth);
    *n0 = c0 * MF_ROWS;
    *n1 = c1 * MF_ROWS < N ? c1 * MF_ROWS : N;
}

#define HIDDEN __attribute__((visibility("hidden")))
/* step.c's ops, each one the per-layer path's call (the region's steps run the same ones, so the same numbers). */
void mf_rmsnorm(const float* x, const float* res, float* sum, const float* w, float eps, int T, int H, float* out);
HIDDEN void mf_rotary(const float* x, const float* c, const float* s, int D, float* y);
HIDDEN float mf_dot(const float* q, const float* k, int D);
HIDDEN int mf_mask_extent(const uint8_t* m, int L);
HIDDEN void mf_attn_head(const float* qh, const float* c, const float* s, int D, const uint8_t* mrow,
                         const float* kh, const float* vh, int L, float scale, float* buf, float* o);
void mf_dense_f32(const float* x, int T, int K, int N, const float* w, float* y);
void mf_softmax_topk(const float* logits, int T, int E, int k, int renorm, float* probs, int32_t* ids,
                     float* weights);
/* mf_layers_step as a sequence of the per-layer calls, each with its own parallel regions (step.c): the path of
   layers with GGUF experts beside a shared expert (gguf.c's mf_gguf_expert opens its own region). Its comment in step.c states the
   arguments and results, which are mf_layers_step's (step_region.c). */
HIDDEN int mf_layers_step_calls(const mf_layer_desc* layers, int n, float* x, int H, const float* cos,
                                const float* sin, void* const* kv, int L, const int64_t* pos, float scale,
                                int32_t* ids, float* weights, int nthreads);
int mf_layers_step(const mf_layer_desc* layers, int n, float* x, int H, const float* cos, const float* sin,
                   void* const* kv, int L, const int64_t* pos, float scale, int32_t* ids, float* weights,
                   int nthreads);
/* The tail of a decode step: the final RMSNorm (norm fp32 [H], eps) and an lm_head of head.n rows: int8 or int4
   (head.bits), or with gguf_type != 0 a GGUF file's blocks of that ggml type (head.w, rows `stride` bytes apart). */
typedef struct {
    const float* norm;
    float eps;
    mf_linear head;
    int gguf_type;
    int64_t stride;
    int candidates;  /* > 0: lm_head.py's refined int4 head: head is int4, then its `candidates` largest logits */
    mf_linear exact;  /* recomputed from these int8 rows (mf_q8_linear_rows' numbers), written in their place */
} mf_head_desc;
#define MF_MAX_CANDIDATES 64
HIDDEN int mf_head_check(const mf_head_desc* head, int H);  /* 0: the tail takes this head (step_head.c) */
/* The refined int4 head's candidates recomputed in int8 into logits (step_head.c's comment). */
HIDDEN int mf_head_refine(const mf_head_desc* head, const float* x, int H, float* logits, int8_t* xq, float* xs);
/* x fp32 [H] -> logits fp32 [head.n] = head(rmsnorm(x)): mf_rmsnorm, then mf_q8_linear / mf_q4_linear /
   mf_gguf_linear's numbers (+ mf_head_refine) (step_head.c; its own parallel region). Returns 0, -1 when out of
   memory, -2 a head it does not take. */
HIDDEN int mf_head_calls(const mf_head_desc* head, const float* x, int H, float* logits, int nthreads);
/* The tail inside an enclosing OpenMP team (step_head.c), called by every thread of it after the last layer: x fp32
   [H] (the thread's own copy of the last layer's output) -> logits fp32 [head.n] (shared), mf_head_calls' numbers
   bit for bit; the rows shared out by an orphaned worksharing loop. scratch: the thread's own
   mf_head_team_bytes(H) bytes, 64-byte aligned. The head must pass mf_head_check. */
HIDDEN size_t mf_head_team_bytes(int H);
HIDDEN void mf_head_team(const mf_head_desc* head, const float* x, int H, float* logits, void* scratch);
/* mf_layers_step, then in the same region the tail: the logits of the token after the last layer (step_region.c):
   the numbers of mf_layers_step followed by mf_head_calls, bit for bit. Returns as mf_layers_step; -2 for a
   head it does not take. */
int mf_decode_step(const mf_layer_desc* layers, int n, float* x, int H, const float* cos, const float* sin,
                   void* const* kv, int L, const int64_t* pos, float scale, int32_t* ids, float* weights,
                   const mf_head_desc* head, float* logits, int nthreads);
#undef HIDDEN
#endif
