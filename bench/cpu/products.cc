// The products of one step of the demo's shapes, one at a time at one thread: the backend's own kernel
// (cpu_small_gemm.h) against OpenBLAS's sgemm. Build from the repository root:
//   g++ -O3 -std=gnu++20 -Isrc -Iinclude bench/cpu/products.cc -lopenblas
// Run as ./a.out (the environment's OPENBLAS_CORETYPE) and env -u OPENBLAS_CORETYPE ./a.out.
#include "backend/cpu/cpu_small_gemm.h"
#include <cblas.h>
#include <cstdio>
#include <vector>
#include <time.h>
static double cpu(){struct timespec t;clock_gettime(CLOCK_PROCESS_CPUTIME_ID,&t);return t.tv_sec+1e-9*t.tv_nsec;}
int main(){
  openblas_set_num_threads(1);
  std::vector<float> a(128*512), b(512*512), c(128*512);
  for(size_t i=0;i<a.size();i++)a[i]=(i%13)*0.01f; for(size_t i=0;i<b.size();i++)b[i]=(i%11)*0.01f;
  struct S{const char* name; bool ta,tb; int m,n,k; bool lower;} cases[]={
    {"RR 128^3 lower NN",0,0,128,128,128,1},{"full 128^3 NN",0,0,128,128,128,0},
    {"XXT 128x128x512 lower NT",0,1,128,128,512,1},{"XXT 128x128x384 lower NT",0,1,128,128,384,1},
    {"QX 128x512x128 NN",0,0,128,512,128,0},{"QX 128x384x128 NN",0,0,128,384,128,0}};
  for(int pass=0;pass<2;pass++) for(auto& s: cases){  // pass 0 warms up, unprinted
    int reps=3000*128/s.k*128/s.n;
    double t=cpu(); for(int r=0;r<reps;r++) distmuon::cpu::small_sgemm(s.ta,s.tb,s.m,s.n,s.k,1.f,a.data(),s.ta?s.m:s.k,b.data(),s.tb?s.k:s.n,0.5f,c.data(),s.n,c.data(),s.n,s.lower);
    double dt=(cpu()-t)/reps; double fl=2.0*s.m*s.n*s.k*(s.lower?0.625:1.0);
    t=cpu(); for(int r=0;r<reps;r++) cblas_sgemm(CblasRowMajor,s.ta?CblasTrans:CblasNoTrans,s.tb?CblasTrans:CblasNoTrans,s.m,s.n,s.k,1.f,a.data(),s.ta?s.m:s.k,b.data(),s.tb?s.k:s.n,0.5f,c.data(),s.n);
    double db=(cpu()-t)/reps;
    if(pass) printf("%-28s own %.1f us (%.0f GF/s of tiles)  openblas full %.1f us\n",s.name,dt*1e6,fl/dt/1e9,db*1e6);
  }
}
