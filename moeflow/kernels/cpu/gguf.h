/* The shared declarations of gguf.c (activations, Q8_0, the entry points) and gguf_k.c (the K-quant blocks): GGUF
   experts on the CPU, see gguf.c's comment. */
#ifndef MOEFLOW_CPU_GGUF_H
#define MOEFLOW_CPU_GGUF_H
#include <stdint.h>
#include <string.h>

#include "native.h"

#define GG_Q4_0 2  /* ggml type ids (ggml.h) */
#define GG_Q8_0 8
#define GG_Q4_K 12
#define GG_Q5_K 13
#define GG_Q6_K 14
#define GG_Q4_KX8 1012  /* not a ggml id: Q4_K rows interleaved 8 at a time (gguf_q4kx8.c), repacked at load */
#define QKK 256    /* elements of a K-quant block */
#define GROWS 16   /* weight rows per parallel work item */
#define GTT 8      /* tokens per tile: a block is decoded once per tile */

static inline int type_block(int type) { return type == GG_Q8_0 || type == GG_Q4_0 ? 32 : QKK; }
/* bytes per block and row (GG_Q4_KX8: 1184 per block of 8 rows, gguf_q4kx8.c's layout) */
static inline int type_bytes(int type) {
    switch (type) {
        case GG_Q4_0: return 18;
        case GG_Q8_0: return 34;
        case GG_Q4_K: return 144;
        case GG_Q5_K: return 176;
        case GG_Q6_K: return 210;
        case GG_Q4_KX8: return 148;
        default: return 0;
    }
}

static inline float h2f(const uint8_t* p) {  /* an fp16 field, exactly */
    uint16_t h;
    memcpy(&h, p, 2);
#if MF_AVX2
    return _cvtsh_ss(h);
#else
    return mf_half_to_float(h);
#endif
}

/* Q4_K / Q5_K's twelve scale bytes -> the 6-bit scales sc[8] and mins m[8] (llama.cpp's get_scale_min_k4 as one
   64-bit word each, byte j = sub-block j): scales 0-3 and mins 0-3 are the low 6 bits of bytes 0-3 and 4-7;
   4-7 take their low 4 bits from bytes 8-11 (scales the low nibbles, mins the high) and their top 2 from the top
   bits of bytes 0-3 (scales) and 4-7 (mins). */
static inline void k4_scales(const uint8_t* s, uint64_t* sc, uint64_t* mn) {
    uint32_t w0, w1, w2;
    memcpy(&w0, s, 4);
    memcpy(&w1, s + 4, 4);
    memcpy(&w2, s + 8, 4);
    const uint32_t lo6 = 0x3F3F3F3Fu, lo4 = 0x0F0F0F0Fu, lo2 = 0x03030303u;
    *sc = (uint64_t)(w0 & lo6) | (uint64_t)((w2 & lo4) | (((w0 >> 6) & lo2) << 4)) << 32;
    *mn = (uint64_t)(w1 & lo6) | (uint64_t)(((w2 >> 4) & lo4) | (((w1 >> 6) & lo2) << 4)) << 32;
}

typedef struct {  /* T rows quantized for one weight type */
    int8_t* q;     /* [T, K] */
    float* s;      /* [T, K / bs] */
    int16_t* sum;  /* [T, K / 16] (K-quants) */
    int32_t* z8;   /* [T, K / 4]: -8 x the sum of codes 4l .. 4l + 3 (Q4_0's zero point, a lane's share) */
    int K, bs, type;
} acts;


#define INLINE static inline __attribute__((always_inline))

/* A token's 8 fp32 lanes, accumulated across a row's blocks by fused multiply-adds and summed once per row as
   ((a0 + a4) + (a2 + a6)) + ((a1 + a5) + (a3 + a7)): the same operations on every build. */
#if MF_AVX2
typedef __m256 facc;
INLINE facc facc_zero(void) { return _mm256_setzero_ps(); }
INLINE float facc_sum(facc a) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}
#else
typedef struct { float v[8]; } facc;
INLINE facc facc_zero(void) { facc a = {{0}}; return a; }
INLINE float facc_sum(facc a) {
    float b[4];
    for (int l = 0; l < 4; l++) b[l] = a.v[l] + a.v[l + 4];
    return (b[0] + b[2]) + (b[1] + b[3]);
}
#endif

/* gguf.c's entry points (also called by step.c's mf_layers_step). */
int mf_gguf_linear(const float* x, int T, int K, int N, int type, const uint8_t* w, int64_t stride, float* y,
                   int nthreads);
int mf_gguf_expert(const float* x, int T, int H, int I, int t13, const uint8_t* gate, const uint8_t* up,
                   int64_t s13, int t2, const uint8_t* down, int64_t s2, const float* weight, float* out,
                   int accumulate, int nthreads);
/* The one-token expert as worksharing loops of the enclosing OpenMP team (gguf.c; step_region.c). */
int mf_gguf_supported(int t13, int H, int t2, int I);
size_t mf_gguf_team_bytes(int H, int I);
void mf_gguf_expert_team(const float* x, int H, int I, int t13, const uint8_t* gate, const uint8_t* up, int64_t s13,
                         int t2, const uint8_t* down, int64_t s2, float weight, float* out, int accumulate, float* h,
                         float* y, void* scratch);

/* One token's rows of a GGUF matrix as a worksharing loop of the enclosing team (gguf.c; step_region.c's tail). */
void mf_gguf_linear_team(const float* x, int K, int N, int type, const uint8_t* w, int64_t stride, float* y,
                         void* scratch);

/* One token's linear rows as worksharing pieces of an enclosing team (gguf.c; step_gptoss.c). */
size_t mf_gguf_acts1_bytes(int K);
void mf_gguf_acts1(const float* x, int K, int type, void* scratch);
void mf_gguf_rows1(int type, const uint8_t* w, int64_t stride, int n0, int n1, int K, const void* scratch, float* y);

/* n K-quant rows dequantized as ggml does (gguf.c; a token embedding's lookup). */
int mf_gguf_dequant_rows(int type, const uint8_t* rows, int n, int K, int64_t stride, float* out);

/* Rows [n0, n1) of a matrix (rows `stride` bytes apart, nb blocks of K-quant `type`: Q4_K, Q5_K, Q6_K) against
   the T quantized tokens of `a`: y[t * ldy + n] (gguf_k.c). */
__attribute__((visibility("hidden"))) void mf_gguf_krows(int type, const uint8_t* w, int64_t stride, int n0, int n1,
                                                         int nb, int T, const acts* a, float* y, int ldy);
/* Rows [n0, n1) (multiples of 8) of a GG_Q4_KX8 matrix against the T tokens of `a`: y[t * ldy + n] (gguf_q4kx8.c;
   gguf_k.c's Q4_K numbers bit for bit). */
__attribute__((visibility("hidden"))) void mf_gguf_x8rows(const uint8_t* w, int64_t stride, int n0, int n1, int nb,
                                                          int T, const acts* a, float* y, int ldy);
#endif
