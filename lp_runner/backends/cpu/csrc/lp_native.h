/* lp_runner's native CPU kernels: one library (backends/cpu/native.py builds it from every source in this folder
   with the same flags, `cc -O3 -march=native -fopenmp -shared -fPIC`, and names the build by a hash of them all).

   gemm.c       the float32 product on weights packed once (float32 or bfloat16 storage): lp_native_gemm_f32,
                lp_native_gemm_bf16w
   attention.c  softmax attention of a few packed rows over a K/V buffer, one segment or several:
                lp_native_attention_f32, lp_native_attention_segments_f32
   layers.c     whole Llama-family decoder layers (norms, rotary, products, attention, SiLU-gated MLP), one or all
                of a model's in one call: lp_native_llama_layer(_bf16w), lp_native_llama_layers(_segments),
                lp_native_silu_gate_f32

   This header holds what the files share: the register tile per instruction set, the vector types, the vector exp
   (attention's softmax and the layers' SiLU), the segment table of a batched round, and the internal entries one
   file calls in another (hidden: the library exports the lp_native_* entries only). Splitting the kernels into
   files moves no arithmetic across a call: every value crosses between files through memory, so the bits are the
   single-file build's (tests/backends/cpu compare builds bit for bit). */
#ifndef LP_NATIVE_H
#define LP_NATIVE_H

#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define LP_INTERNAL __attribute__((visibility("hidden")))

#define NB 32

/* The register tile, per instruction set: a pass over a block takes up to MR rows and the block's NV vectors of
   VL columns, with MM * NV accumulators, NV weight vectors and one broadcast in registers. Whole blocks: a pass
   over half a block reads every other cache line of the block's stream, which measured up to 2x slower than the
   same arithmetic over the whole block (AVX2 and SSE builds on an x86 CPU).
   AVX-512 (32 registers of 16 floats): 8 rows x 2 vectors (19 registers). AVX2 (16 registers of 8): 3 rows x 4
   (12 accumulators, the weights as memory operands where registers run out); the AVX-512 tile there (8 rows x
   4 vectors) spilled every accumulator on every k: built with -mno-avx512f on an AVX-512 CPU it
   was 3.7x slower at one row and 28x at 8 than the AVX-512 build. Others (NEON's 32 or SSE's 16 registers of 4
   floats): 2 rows x 8 (16 accumulators, 8 weights: 25 on NEON; SSE takes the weights from memory). Every
   output is the same sum in the same order whatever the tile, so every target with FMA gives the same bits
   (tests/backends/cpu/test_native_isa.py). */
#if defined(__AVX512F__)
#define VL 16
#define MR 8
#define NV 2
#elif defined(__AVX__)
#define VL 8
#define MR 3
#define NV 4
#else
#define VL 4
#define MR 2
#define NV 8
#endif
typedef float vec __attribute__((vector_size(VL * 4), aligned(4)));
typedef float v16 __attribute__((vector_size(64), aligned(4)));

_Static_assert(VL * NV == NB, "a pass covers a whole block");

typedef int veci __attribute__((vector_size(VL * 4), aligned(4)));

/* e^x per lane for x <= 0 (softmax's shifted scores): Cephes' expf, the exponent scaled in by integer add;
   x below -87.3 gives exactly 0 (a hidden key's -inf among them). Within 2 ulp of expf over [-87.3, 0]. */
static inline vec expv(vec x) {
  const vec lo = (vec){0} - 87.3f;
  veci keep = x >= lo;
  x = (vec)((veci)x & keep) + (vec)((veci)lo & ~keep); /* clamp without a NaN-prone min */
  vec t = x * 1.44269504088896341f + 12582912.0f;        /* round(x / ln 2) in the low mantissa bits */
  vec n = t - 12582912.0f;
  x = x - n * 0.693359375f - n * -2.12194440e-4f;
  vec y = 1.9875691500e-4f * x + 1.3981999507e-3f;
  y = y * x + 8.3334519073e-3f;
  y = y * x + 4.1665795894e-2f;
  y = y * x + 1.6666665459e-1f;
  y = y * x + 5.0000001201e-1f;
  y = y * x * x + x + 1.0f;
  veci scale = ((veci)t - 0x4B400000 + 127) << 23; /* 2^n */
  return (vec)((veci)(y * (vec)scale) & keep);
}

/* The rows of one call that share a K/V region: the generations of a batched round (lp_runner/backends/cpu/native.py, SegmentTable).
   Segment b holds round rows [start[b], start[b + 1]); its key j is slot base[b] + j of the buffer, for j below
   width[b]; its mask rows are width[b] floats each, at mask + moff[b], its rows in order. No row of a segment
   reads another segment's keys or mask. A plain round is one segment: rows [0, Q), base 0, width C, offset 0. */
struct segments {
  long n;
  const long *start, *base, *width, *moff;
};

/* The sizes of a segment table: rows [0, Q) covered in order, each region inside the C slots. */
static inline int segments_ok(const struct segments *sg, long Q, long C) {
  if (sg->n < 1 || sg->start[0] != 0 || sg->start[sg->n] != Q) return 0;
  for (long b = 0; b < sg->n; b++)
    if (sg->start[b + 1] <= sg->start[b] || sg->base[b] < 0 || sg->width[b] < 1 || sg->moff[b] < 0 ||
        sg->base[b] + sg->width[b] > C)
      return 0;
  return 1;
}

/* The product's blocks on weights stored as float32 (gemm_f_) or bfloat16 bits (gemm_h_): gemm.c. */
LP_INTERNAL int gemm_f_(const float *x, const float *p, const float *b, float *y, long M, long N, long K, int threads);
LP_INTERNAL int gemm_h_(const float *x, const unsigned short *p, const float *b, float *y, long M, long N, long K,
                        int threads);
/* Attention over a segment table: attention.c. */
LP_INTERNAL int attention_segments(const float *q, const float *k, const float *v, const float *mask, float *out,
                                   long H, long M, long Q, long D, long ks, long vs, float scale, int threads,
                                   const struct segments *sg);

/* The exported entries (native.py types them with ctypes; tests/backends/cpu/native_harness.c calls them). */
int lp_native_gemm_f32(const float *x, const float *p, const float *b, float *y, long M, long N, long K, int threads);
int lp_native_gemm_bf16w(const float *x, const unsigned short *p, const float *b, float *y, long M, long N, long K,
                         int threads);
int lp_native_attention_f32(const float *q, const float *k, const float *v, const float *mask, float *out, long H,
                            long M, long Q, long C, long D, long ks, long vs, float scale, int threads);
int lp_native_attention_segments_f32(const float *q, const float *k, const float *v, const float *mask, float *out,
                                     long H, long M, long Q, long C, long D, long ks, long vs, float scale,
                                     int threads, long nseg, const long *start, const long *base, const long *width,
                                     const long *moff);
int lp_native_silu_gate_f32(const float *gu, float *act, long R, long I);
int lp_native_llama_layers(float *h, long L, void *const *ptrs, const float *eps, const long *kv_strides,
                           const float *const *masks, const float *cos, const float *sin, const long *slots, long C,
                           long R, long E, long H, long Hkv, long D, long I, float scale, int threads, int bf16);
int lp_native_llama_layers_segments(float *h, long L, void *const *ptrs, const float *eps, const long *kv_strides,
                                    const float *const *masks, const float *cos, const float *sin, const long *slots,
                                    long C, long R, long E, long H, long Hkv, long D, long I, float scale,
                                    int threads, int bf16, long nseg, const long *start, const long *base,
                                    const long *width, const long *moff);
int lp_native_llama_layer(float *h, const float *ln1, const float *ln2, float eps, const float *wqkv,
                          const float *bqkv, const float *wo, const float *bo, const float *wgu, const float *bgu,
                          const float *wd, const float *bd, const float *cos, const float *sin, float *kbuf,
                          float *vbuf, long ks, long vs, const long *slots, const float *mask, long C, long R, long E,
                          long H, long Hkv, long D, long I, float scale, int threads);
int lp_native_llama_layer_bf16w(float *h, const float *ln1, const float *ln2, float eps, const unsigned short *wqkv,
                                const float *bqkv, const unsigned short *wo, const float *bo,
                                const unsigned short *wgu, const float *bgu, const unsigned short *wd,
                                const float *bd, const float *cos, const float *sin, float *kbuf, float *vbuf,
                                long ks, long vs, const long *slots, const float *mask, long C, long R, long E, long H,
                                long Hkv, long D, long I, float scale, int threads);

#endif
