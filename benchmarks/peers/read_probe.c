/* The machine's plain read bandwidth, the roofline of a memory-bound decode step (issue 42): a 512 MB buffer read
   with 4 independent streams of the widest loads the build has (512-bit with AVX-512, else 256-bit), OpenMP static
   split, best of 7 passes, for 1 .. max threads given on the command line. Prints one JSON object
   {"1": GB/s, "2": GB/s, ...}. Built and run by decode_roofline.py (gcc -O2 -march=native -fopenmp). */
#include <immintrin.h>
#include <omp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

int main(int argc, char** argv) {
    const int maxt = argc > 1 ? atoi(argv[1]) : 2;
    const size_t n = (size_t)512 << 20;
    char* p = aligned_alloc(64, n);
    if (!p) return 1;
    memset(p, 1, n);
    printf("{");
    for (int t = 1; t <= maxt; t++) {
        double best = 0.0;
        for (int r = 0; r < 7; r++) {
            const double t0 = omp_get_wtime();
            long long tot = 0;
#pragma omp parallel num_threads(t) reduction(+ : tot)
            {
#if defined(__AVX512F__)
                __m512i a = _mm512_setzero_si512(), b = a, c = a, d = a;
#pragma omp for schedule(static)
                for (size_t i = 0; i < n; i += 256) {
                    a = _mm512_add_epi64(a, _mm512_load_si512(p + i));
                    b = _mm512_add_epi64(b, _mm512_load_si512(p + i + 64));
                    c = _mm512_add_epi64(c, _mm512_load_si512(p + i + 128));
                    d = _mm512_add_epi64(d, _mm512_load_si512(p + i + 192));
                }
                tot += _mm512_reduce_add_epi64(_mm512_add_epi64(_mm512_add_epi64(a, b), _mm512_add_epi64(c, d)));
#else
                __m256i a = _mm256_setzero_si256(), b = a, c = a, d = a;
#pragma omp for schedule(static)
                for (size_t i = 0; i < n; i += 128) {
                    a = _mm256_add_epi64(a, _mm256_load_si256((const __m256i*)(p + i)));
                    b = _mm256_add_epi64(b, _mm256_load_si256((const __m256i*)(p + i + 32)));
                    c = _mm256_add_epi64(c, _mm256_load_si256((const __m256i*)(p + i + 64)));
                    d = _mm256_add_epi64(d, _mm256_load_si256((const __m256i*)(p + i + 96)));
                }
                __m256i s = _mm256_add_epi64(_mm256_add_epi64(a, b), _mm256_add_epi64(c, d));
                tot += _mm256_extract_epi64(s, 0);
#endif
            }
            const double gbps = n / (omp_get_wtime() - t0) / 1e9;
            if (gbps > best) best = gbps;
            if (tot == 42) puts("");
        }
        printf("%s\"%d\": %.2f", t > 1 ? ", " : "", t, best);
    }
    printf("}\n");
    free(p);
    return 0;
}
