/* Every float through mf_exp8 (moeflow/kernels/cpu/native.h, the AVX2 expf of the experts' silu) against libm's
   expf, bit for bit (NaN against NaN). glibc >= 2.27 on an FMA machine: 0 mismatches expected (2026-11-24, glibc
   2.36, AMD EPYC: 4294967296 checked, 0 mismatches, ~1 min on one core). Usage, from the repository root:

     gcc -O2 -march=native -ffp-contract=off -fopenmp -Imoeflow/kernels/cpu benchmarks/peers/cpu_expf_check.c \
         moeflow/kernels/cpu/native.c moeflow/kernels/cpu/q4.c moeflow/kernels/cpu/q8.c moeflow/kernels/cpu/step.c \
         -lm -o /tmp/cpu_expf_check && /tmp/cpu_expf_check [STRIDE]

   STRIDE > 1 checks every STRIDE-th vector of 8 floats only. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "native.h"

int main(int argc, char** argv) {
#if MF_AVX2
    unsigned long long stride = argc > 1 ? strtoull(argv[1], NULL, 0) : 1, bad = 0, n = 0;
    for (unsigned long long b = 0; b < (1ull << 32); b += 8 * stride) {
        uint32_t u[8];
        float x[8], v[8];
        for (int i = 0; i < 8; i++) u[i] = (uint32_t)(b + i);
        memcpy(x, u, sizeof x);
        _mm256_storeu_ps(v, mf_exp8(_mm256_loadu_ps(x)));
        for (int i = 0; i < 8; i++, n++) {
            float r = expf(x[i]);
            if (memcmp(&r, &v[i], 4) && !(r != r && v[i] != v[i]) && bad++ < 10)
                printf("x = %a: mf_exp8 %a, expf %a\n", x[i], v[i], r);
        }
    }
    printf("%llu floats checked, %llu mismatches\n", n, bad);
    return bad != 0;
#else
    (void)argc, (void)argv;
    puts("not an AVX2 + FMA build: nothing to check");
    return 0;
#endif
}
