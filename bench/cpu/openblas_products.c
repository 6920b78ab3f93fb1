/* OpenBLAS alone on the demo's product shapes at one thread: sgemm, ssyrk, and a lower triangle as
   row blocks of 64 and 32 (what gemm_symmetric could have asked of BLAS). gcc -O2 FILE -lopenblas;
   run with the environment's OPENBLAS_CORETYPE (Haswell) and without it (Cooperlake). */
#include <cblas.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>
static double cpu(){struct timespec t;clock_gettime(CLOCK_PROCESS_CPUTIME_ID,&t);return t.tv_sec+1e-9*t.tv_nsec;}
int main(){
  openblas_set_num_threads(1);
  int N=512; float *a=malloc(4*N*N*4),*b=malloc(4*N*N*4),*c=malloc(4*N*N*4);
  for(int i=0;i<N*N*4;i++){a[i]=rand()/(float)RAND_MAX;b[i]=rand()/(float)RAND_MAX;c[i]=0;}
  int ks[]={128,384,512};
  printf("%s\n", openblas_get_config());
  for(int w=0;w<300;w++) cblas_sgemm(CblasRowMajor,CblasNoTrans,CblasTrans,128,128,128,1,a,128,b,128,0,c,128);  /* warm-up */
  for(int ki=0;ki<3;ki++){int k=ks[ki]; int reps=2000*128/k;
    double t=cpu(); for(int r=0;r<reps;r++) cblas_sgemm(CblasRowMajor,CblasNoTrans,CblasTrans,128,128,k,1,a,k,b,k,0,c,128);
    double dt=(cpu()-t)/reps; printf("sgemm NT 128x128x%d: %.1f us %.1f GF/s\n",k,dt*1e6,2.0*128*128*k/dt/1e9);
    t=cpu(); for(int r=0;r<reps;r++) cblas_ssyrk(CblasRowMajor,CblasLower,CblasNoTrans,128,k,1,a,k,0,c,128);
    dt=(cpu()-t)/reps; printf("ssyrk 128x%d: %.1f us (%.1f GF/s of full)\n",k,dt*1e6,2.0*128*128*k/dt/1e9);
    t=cpu(); for(int r=0;r<reps;r++) cblas_sgemm(CblasRowMajor,CblasNoTrans,CblasNoTrans,128,k,128,1,a,128,b,k,0,c,k);
    dt=(cpu()-t)/reps; printf("sgemm NN 128x%dx128 (Q X): %.1f us %.1f GF/s\n",k,dt*1e6,2.0*128*128*k/dt/1e9);
  }
  double t=cpu(); int reps=2000;
  for(int r=0;r<reps;r++){ cblas_sgemm(CblasRowMajor,CblasNoTrans,CblasNoTrans,64,64,128,1,a,128,b,128,0,c,128); cblas_sgemm(CblasRowMajor,CblasNoTrans,CblasNoTrans,64,128,128,1,a+64*128,128,b,128,0,c+64*128,128);}
  double dt=(cpu()-t)/reps; printf("lower by 2 blocks of 64: %.1f us\n",dt*1e6);
  t=cpu();
  for(int r=0;r<reps;r++){ for(int b0=0;b0<128;b0+=32) cblas_sgemm(CblasRowMajor,CblasNoTrans,CblasNoTrans,32,b0+32,128,1,a+b0*128,128,b,128,0,c+b0*128,128);}
  dt=(cpu()-t)/reps; printf("lower by 4 blocks of 32: %.1f us\n",dt*1e6);
  return 0;}
