/* The shared declarations of mxfp4.c (the MXFP4 row kernels and the entry points) and mxfp4_epilogue.c (the
   activations quantized per block of 32, the expert's gate/up and down epilogues): native MXFP4 experts on the CPU,
   see mxfp4.c's comment. */
#ifndef MOEFLOW_CPU_MXFP4_H
#define MOEFLOW_CPU_MXFP4_H
#include <stdint.h>

#include "native.h"

#define MX_SILU 0
#define MX_SWIGLU 1
#define MX_BIAS_F32 0
#define MX_BIAS_BF16 1
#define MX_BIAS_F16 2
#define MXI static inline __attribute__((always_inline))
#define MX_HIDDEN __attribute__((visibility("hidden")))

typedef struct {  /* T tokens quantized for K inputs */
    int8_t* q;  /* [T, nbp, 64]: per block pair 64 codes, the two registers' orders */
    float* s;   /* [T, nbp, 8]: per block pair xs of block 2bp x4, of 2bp + 1 x4 (0 for a missing odd block) */
    int nbp;    /* block pairs: ceil(K / 64) */
} mxacts;

/* mxfp4_epilogue.c: the activations (a, T tokens of K inputs: 0 or -1 out of memory; free after either answer;
   token t of x fp32 [K] into a), the gate activation of one token (h fp32 [2I]: gate rows then up, + bias13 [2I]
   of `kind` or NULL -> out fp32 [I]; act MX_SILU or MX_SWIGLU with alpha, limit), and the down projection's
   outputs n0 .. n1 - 1 of T tokens (y fp32 [T, H] + bias2 [H] or NULL, times weight [t] -> out [T, H], added to
   it when accumulate). */
MX_HIDDEN int mx_acts_alloc(mxacts* a, int T, int K);
MX_HIDDEN void mx_acts_free(mxacts* a);
MX_HIDDEN void mx_acts_row(mxacts* a, const float* x, int K, int t);
MX_HIDDEN void mx_gate_up(const float* h, float* out, int I, const void* bias13, int kind, int act, float alpha,
                          float limit);
MX_HIDDEN void mx_down_out(const float* y, int T, int H, int n0, int n1, const void* bias2, int kind,
                           const float* weight, float* out, int accumulate);
/* mxfp4.c: rows [n0, n1) of W [N, K] (region layout, panels of `panel`) against token 0 of a -> y [N]; the rows of
   mf_mxfp4_linear / mf_mxfp4_expert bit for bit (step_gptoss.c calls it on each thread's share of rows). */
MX_HIDDEN void mf_mxfp4_rows1(const uint8_t* blocks, const uint8_t* scales, int N, int K, int panel, int n0, int n1,
                              const mxacts* a, float* y);
#endif
