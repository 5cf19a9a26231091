/* Fresh anonymous memory on this machine: first touch (fault + zero) of 4 KB pages against 2 MB transparent huge
   pages (MADV_HUGEPAGE), on one and two threads, then writing them (memcpy of 16 MB-ish slices); copying into fresh
   memory directly; MADV_POPULATE_WRITE then copy; and MADV_COLLAPSE of memory written on 4 KB pages (Linux 6.1+).
   Issue 37 / session 18: where the huge-page load cost goes. Each case sleeps SLEEP seconds first, so that the
   memory the previous case freed has been reported to the host by a virtio balloon's free page reporting
   (/sys/module/page_reporting: it reports free blocks of 2^page_reporting_order pages after ~2 s), as a model
   load's fresh memory would be. Prints GB/s and the kernel's thp_fault_alloc / compact_stall deltas.

     gcc -O2 -pthread benchmarks/disk/fresh_pages_probe.c -o /tmp/fresh_pages_probe && /tmp/fresh_pages_probe 3 */
#define _GNU_SOURCE
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>
#include <unistd.h>
#ifndef MADV_POPULATE_WRITE
#define MADV_POPULATE_WRITE 23
#endif
#ifndef MADV_COLLAPSE
#define MADV_COLLAPSE 25
#endif
#define HP ((size_t)2 << 20)
static const size_t N = (size_t)512 << 20;
static char *src;
static double now(void) { struct timespec t; clock_gettime(CLOCK_MONOTONIC, &t); return t.tv_sec + t.tv_nsec * 1e-9; }
static long vmstat(const char *key) {
    FILE *f = fopen("/proc/vmstat", "r"); char name[64]; long v, r = -1;
    while (f && fscanf(f, "%63s %ld", name, &v) == 2) if (!strcmp(name, key)) r = v;
    if (f) fclose(f);
    return r;
}
static char *fresh(int huge) {  /* a 2 MB aligned anonymous region of N bytes, advised or not */
    char *p = mmap(0, N + HP, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    p = (char *)(((uintptr_t)p + HP - 1) & ~(uintptr_t)(HP - 1));
    madvise(p, N, huge ? MADV_HUGEPAGE : MADV_NOHUGEPAGE);
    return p;
}
typedef struct { char *p; size_t lo, hi; int op; } job;
enum { TOUCH, COPY, POPULATE, COLLAPSE };
static void *run(void *a) {
    job *j = a;
    if (j->op == TOUCH) for (size_t i = j->lo; i < j->hi; i += 4096) j->p[i] = 1;
    else if (j->op == COPY) memcpy(j->p + j->lo, src + j->lo, j->hi - j->lo);
    else if (j->op == POPULATE) madvise(j->p + j->lo, j->hi - j->lo, MADV_POPULATE_WRITE);
    else for (size_t i = j->lo; i < j->hi; i += HP) madvise(j->p + i, HP, MADV_COLLAPSE);
    return 0;
}
static double par(char *p, int op, int nt) {
    pthread_t t[8]; job j[8]; double t0 = now(); size_t per = N / nt;
    for (int i = 0; i < nt; i++) { j[i] = (job){p, i * per, (i + 1) * per, op}; pthread_create(&t[i], 0, run, &j[i]); }
    for (int i = 0; i < nt; i++) pthread_join(t[i], 0);
    return now() - t0;
}
int main(int argc, char **argv) {
    int sl = argc > 1 ? atoi(argv[1]) : 3, reps = argc > 2 ? atoi(argv[2]) : 2;
    double gb = N / 1e9;
    src = malloc(N); memset(src, 3, N);
    for (int rep = 0; rep < reps; rep++)
        for (int huge = 0; huge < 2; huge++)
            for (int nt = 1; nt <= 2; nt++) {
                long f0 = vmstat("thp_fault_alloc"), s0 = vmstat("compact_stall");
                sleep(sl); char *p = fresh(huge); double a = par(p, TOUCH, nt), b = par(p, COPY, nt); munmap(p, N);
                sleep(sl); char *q = fresh(huge); double c = par(q, COPY, nt), h = -1;
                if (!huge) { madvise(q, N, MADV_HUGEPAGE); h = par(q, COLLAPSE, nt); }
                munmap(q, N);
                sleep(sl); char *s = fresh(huge); double e = par(s, POPULATE, nt), e2 = par(s, COPY, nt); munmap(s, N);
                printf("%s threads=%d | touch %.2f GB/s, then copy %.2f (both %.2f) | copy into fresh %.2f | "
                       "populate %.2f, then copy %.2f (both %.2f) | collapse of the 4K-written copy %.2f | "
                       "thp_fault_alloc +%ld compact_stall +%ld\n", huge ? "2M" : "4K", nt, gb / a, gb / b,
                       gb / (a + b), gb / c, gb / e, gb / e2, gb / (e + e2), h > 0 ? gb / h : 0.0,
                       vmstat("thp_fault_alloc") - f0, vmstat("compact_stall") - s0);
                fflush(stdout);
            }
    return 0;
}
