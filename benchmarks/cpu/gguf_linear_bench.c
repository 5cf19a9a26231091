/* GGUF K-quant / Q8_0 linear kernel (moeflow/kernels/cpu/gguf.c: mf_gguf_linear) alone, one thread, from memory:
   `mats` distinct [N, K] matrices of ggml type `type` (12 Q4_K, 13 Q5_K, 14 Q6_K, 8 Q8_0) called in turn, 8
   passes; GB/s of matrix bytes from the median call (wall time; calls of ~50 us are rarely descheduled), and a
   checksum of the outputs (the same bits before and after a kernel change give the same checksum). Build it
   against a source tree (the before / after pair of benchmarks/results/peers/s16/):

     S=moeflow/kernels/cpu; gcc -O3 -march=native -ffp-contract=off -fopenmp benchmarks/cpu/gguf_linear_bench.c \
         $S/native.c $S/q4.c $S/q4z.c $S/q8.c $S/step.c $S/repack.c $S/gguf.c $S/gguf_k.c -o /tmp/gguf_bench -lm
     /tmp/gguf_bench 12 768 2048 48    # Q4_K gate/up of Qwen3-30B-A3B, 48 matrices (42 MB)
     /tmp/gguf_bench 14 2048 768 40    # Q6_K down
*/
#include <stdio.h>
#include <stdlib.h>
#include <stdint.h>
#include <string.h>
#include <time.h>
#include <sys/mman.h>
int mf_gguf_linear(const float* x, int T, int K, int N, int type, const uint8_t* w, int64_t stride, float* y, int nthreads);
static double now(void){struct timespec t;clock_gettime(CLOCK_MONOTONIC,&t);return t.tv_sec+1e-9*t.tv_nsec;}
static int tb(int t){return t==12?144:t==13?176:t==14?210:34;}
static int bs(int t){return t==8?32:256;}
static int cmp(const void*a,const void*b){double d=*(const double*)a-*(const double*)b; return d<0?-1:d>0;}
int main(int argc,char**argv){
  int type=atoi(argv[1]), N=atoi(argv[2]), K=atoi(argv[3]), nm=atoi(argv[4]), T=argc>5?atoi(argv[5]):1;
  size_t rb=(size_t)K/bs(type)*tb(type), mb=rb*N;
  uint8_t* w=aligned_alloc(1<<21,(mb*nm+(1<<21))&~((size_t)(1<<21)-1)); if(getenv("HUGE")) madvise(w,mb*nm,MADV_HUGEPAGE); srand(1);
  for(size_t i=0;i<mb*nm;i++) w[i]=rand();
  /* small fp16 scales */
  for(size_t r=0;r<(size_t)N*nm;r++) for(int b=0;b<K/bs(type);b++){uint8_t*p=w+r*rb+(size_t)b*tb(type);
    int off = type==14?208:0; p[off]=rand(); p[off+1]=0x10; if(type==12||type==13){p[2]=rand();p[3]=0x10;}}
  float*x=malloc(4*(size_t)K*T),*y=malloc(4*(size_t)N*T); for(int i=0;i<K*T;i++) x[i]=(rand()%2001-1000)/1000.0f;
  int reps=8; double* ct=malloc(sizeof(double)*reps*nm); int nc=0;
  for(int rep=0;rep<reps;rep++){ for(int m=0;m<nm;m++){double t0=now(); mf_gguf_linear(x,T,K,N,type,w+mb*m,rb,y,1); ct[nc++]=now()-t0;}}
  qsort(ct,nc,sizeof(double),cmp); double best=ct[nc/2]*nm; /* median call */
  double cs=0; for(int i=0;i<N*T;i++) cs+=y[i];
  printf("type %d N %d K %d mats %d T %d: %.2f GB/s  (%.1f ns/block) checksum %.6g\n",type,N,K,nm,T,mb*nm/best/1e9, best/((double)nm*N*K/bs(type))*1e9, cs);
  return 0;}
