/* lp_runner's native fp32 product for CPU forwards (lp_runner/native.py builds and loads it; model.prepack).

   y[m*N + n] = sum_k x[m*K + k] * w[n][k] (+ b[n]) for m < M, n < N, with the weight packed once
   (native.pack) into blocks of NB output columns: p[block][k][c] = w[block*NB + c][k], the last block zero-padded.
   One block is one contiguous stream of K*NB floats; for up to MR input rows at a time (8 with AVX-512), each k
   loads the block's vectors once and multiplies them into accumulators per row (x[m][k] broadcast): no
   horizontal sums, no re-reads of the weight from memory, so a forward of 1-8 rows costs about the weights'
   bytes over the memory bandwidth. Blocks split over OpenMP threads (torch's libgomp: the same soname, already
   loaded).

   Every output is the sum over k in increasing order of one row and one column, whatever M, the row's place in
   the call or the block the column falls in: a row's result does not depend on the rows beside it, and the
   columns of stacked sibling weights are those of each weight alone (bit for bit). */
#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define NB 32

/* The register tile, per instruction set: a pass over a block takes up to MR rows and the block's NV vectors of
   VL columns, with MM * NV accumulators, NV weight vectors and one broadcast in registers. Whole blocks: a pass
   over half a block reads every other cache line of the block's stream, which measured up to 2x slower than the
   same arithmetic over the whole block (on this project's EPYC, AVX2 and SSE builds).
   AVX-512 (32 registers of 16 floats): 8 rows x 2 vectors (19 registers). AVX2 (16 registers of 8): 3 rows x 4
   (12 accumulators, the weights as memory operands where registers run out); the AVX-512 tile there (8 rows x
   4 vectors) spilled every accumulator on every k: built with -mno-avx512f on this project's AVX-512 machine it
   was 3.7x slower at one row and 28x at 8 than the AVX-512 build. Others (NEON's 32 or SSE's 16 registers of 4
   floats): 2 rows x 8 (16 accumulators, 8 weights: 25 on NEON; SSE takes the weights from memory). Every
   output is the same sum in the same order whatever the tile, so every target with FMA gives the same bits
   (tests/test_native_isa.py). */
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

/* The weights' storage: float32, or bfloat16 (model.prepack=native-bf16): the upper half of a float32, so a
   weight widens to the float32 value exactly and the products that follow are the float32 kernel's, bit for bit,
   on the rounded weights; half the bytes streamed per forward. In a block's row of 32 bfloat16 weights (one
   64-byte line per k), 32-bit word i holds column i in its low half and column i + 16 in its high half
   (native.pack), so one shift (columns 0-15) or one mask (16-31) of a plain vector load widens VL columns: one
   integer op per weight vector, where zero-extending 16-bit lanes took a shuffle and a shift, and cost the 8-row
   product a fifth of its speed (the shuffles compete with the FMAs). Any VL up to 16 reads whole words. */
typedef unsigned int uvec __attribute__((vector_size(VL * 4), aligned(4)));
#define LOAD_F32(row, j) (*(const vec *)((row) + (j) * VL))
static inline __attribute__((always_inline)) vec load_bf16(const unsigned short *row, int j) {
  int c = j * VL; /* the first of the VL columns */
  uvec w = *(const uvec *)(row + 2 * (c & 15));
  return (vec)(c < 16 ? w << 16 : w & 0xffff0000u);
}
#define LOAD_BF16(row, j) load_bf16(row, j)

/* The AVX2 tile (3 rows x 4 vectors, 12 accumulators and a broadcast in 16 registers) holds two of the k's four
   weight vectors in registers (an empty asm the compiler cannot see through) and takes the other two as memory
   operands. Left to itself GCC took all four from memory in every row's FMA: 12 weight loads and 3 broadcasts per
   12 FMAs, more than two loads a cycle can feed, so the multi-pass products (rows above one tile, whose later
   passes read L1) ran load-bound; now 11 loads. Products of the embedded model's linears, AVX2 build on this
   project's EPYC (Zen 4), interleaved A/B of the two sources: 12-24 rows 1.19-1.25x faster, 4 rows 1.05x, 1-3 and
   8 rows within noise (2026-12-03). Holding three spends the last register and measured the same; four spilled
   (12-24 rows 1.1-1.2x slower than holding none). The arithmetic is the same: the same bits. */
#if VL == 8
#define PIN_WEIGHTS(w)                                                                                      \
  for (int j = 0; j < 2; j++) __asm__("" : "+x"(w[j]))
#else
#define PIN_WEIGHTS(w) (void)0
#endif

/* The tile's loop over k in [0, KN): the block's vectors loaded once per k (LOAD: from the weights' storage),
   multiplied into MM rows' accumulators a[MM][NV] (x[m][k] broadcast); PREFETCH is a statement run at the top of
   each k. */
#define TILE_LOOP(MM, KN, PREFETCH, LOAD)                                                                   \
  for (int k = 0; k < (KN); k++) {                                                                        \
    PREFETCH;                                                                                             \
    vec w[NV];                                                                                            \
    for (int j = 0; j < NV; j++) w[j] = LOAD(pb + (size_t)k * NB, j);                                      \
    PIN_WEIGHTS(w);                                                                                       \
    for (int m = 0; m < MM; m++) {                                                                        \
      float xs = x[(size_t)m * K + k];                                                                    \
      for (int j = 0; j < NV; j++) a[m][j] += w[j] * xs;                                                  \
    }                                                                                                     \
  }

/* A pass of one tile of WHOLE_PREFETCH_ROWS rows or more over a whole block prefetches its weights WHOLE_PREFETCH_K
   k's ahead (4 KB in float32) into L2, past the block's end into the next block's start (the packed blocks are
   one contiguous stream; a prefetch never faults, and integer arithmetic forms its address). Why: without it the
   8-row product of the embedded model's linears ran either near one row's cost or 1.4-1.5x it, minute by
   minute on this project's EPYC (Zen 4), the arithmetic no longer hidden under the stream; in six interleaved
   comparisons the plain pass's slow moments cost 26.7 and 28.5 ms against 18.5 and 20.3 with the prefetch, and
   the whole 8-row forward ran 1.02-1.15x faster in three A/B runs (2026-12-03). It lowers the 8-row cost; the
   ratio to one row still moves with the host (1.12-1.51x since). At 4-5 rows it cost 4-6%: the hardware
   prefetcher keeps up there, and the prefetches only add work. The AVX2 and SSE tiles (3 and 2 rows) never
   reach it; their multi-tile products prefetch by chunk (below). */
#define WHOLE_PREFETCH_ROWS 6
#define WHOLE_PREFETCH_K 32
#define WHOLE_PREFETCH(MM, WT)                                                                              \
  if ((MM) >= WHOLE_PREFETCH_ROWS)                                                                        \
    for (int q = 0; q < (int)(NB * sizeof(WT) / 64); q++)                                                 \
      __builtin_prefetch(                                                                                 \
          (const void *)((uintptr_t)pb + (size_t)(k + WHOLE_PREFETCH_K) * NB * sizeof(WT) + 64 * (size_t)q), 0, 2)

/* whole_SUF_MM: one pass of MM rows over the whole K of a block, into out (row stride N, ncols columns).
   chunk_SUF_MM: one pass over k in [0, kn) of a block (a chunk of its K): the accumulators start at zero (first)
   or from acc and end in acc ([MM][NB]) (storing and reloading a float sum between chunks changes no bit); each
   k also prefetches the next lines of pf into L2 and the same lines of near into L1, lines / its of them a k on
   average (a running remainder, phase, that the caller starts). Two functions, so the one-pass path (every 1-row
   forward) carries no branch of the other.
   SUF, WT, LOAD: the weights' storage (f_: float; h_: bfloat16 bits). */
#define WHOLE_OF(MM, SUF, WT, LOAD)                                                                         \
  static inline void whole_##SUF##MM(const float *x, const WT *pb, float *out, int N, int K, int ncols) {  \
    vec a[MM][NV];                                                                                        \
    for (int m = 0; m < MM; m++)                                                                          \
      for (int j = 0; j < NV; j++) a[m][j] = (vec){0};                                                    \
    TILE_LOOP(MM, K, WHOLE_PREFETCH(MM, WT), LOAD)                                                        \
    for (int m = 0; m < MM; m++) {                                                                        \
      float tmp[NB];                                                                                      \
      memcpy(tmp, a[m], sizeof tmp);                                                                      \
      memcpy(out + (size_t)m * N, tmp, sizeof(float) * (size_t)ncols);                                    \
    }                                                                                                     \
  }
#define CHUNK_OF(MM, SUF, WT, LOAD)                                                                         \
  static inline void chunk_##SUF##MM(const float *x, const WT *pb, float *acc, int K, int kn, int first,     \
                                const char *pf, const char *near, int lines, int its, int phase) {       \
    vec a[MM][NV];                                                                                        \
    for (int m = 0; m < MM; m++)                                                                          \
      for (int j = 0; j < NV; j++) a[m][j] = first ? (vec){0} : *(const vec *)(acc + m * NB + j * VL);   \
    int q = 0;                                                                                            \
    TILE_LOOP(                                                                                            \
        MM, kn,                                                                                           \
        for (phase += lines; phase >= its; phase -= its, q++) {                                           \
          __builtin_prefetch(pf + (size_t)q * 64, 0, 2);                                                  \
          __builtin_prefetch(near + (size_t)q * 64, 0, 3);                                                \
        },                                                                                                \
        LOAD)                                                                                             \
    for (int m = 0; m < MM; m++)                                                                          \
      for (int j = 0; j < NV; j++) *(vec *)(acc + m * NB + j * VL) = a[m][j];                             \
  }
#define MICRO(MM)                                                                                           \
  WHOLE_OF(MM, f_, float, LOAD_F32)                                                                       \
  WHOLE_OF(MM, h_, unsigned short, LOAD_BF16)                                                             \
  CHUNK_OF(MM, f_, float, LOAD_F32) CHUNK_OF(MM, h_, unsigned short, LOAD_BF16)
MICRO(1)
#if MR >= 2
MICRO(2)
#endif
#if MR >= 3
MICRO(3)
#endif
#if MR >= 8
MICRO(4) MICRO(5) MICRO(6) MICRO(7) MICRO(8)
#endif

/* KIND##mm(ARGS) for mm rows (1 <= mm <= MR): KIND is whole_f_, whole_h_, chunk_f_ or chunk_h_. */
#if MR >= 8
#define DISPATCH(KIND, mm, ARGS)                                                                            \
  switch (mm) {                                                                                           \
    case 1: KIND##1 ARGS; break;                                                                          \
    case 2: KIND##2 ARGS; break;                                                                          \
    case 3: KIND##3 ARGS; break;                                                                          \
    case 4: KIND##4 ARGS; break;                                                                          \
    case 5: KIND##5 ARGS; break;                                                                          \
    case 6: KIND##6 ARGS; break;                                                                          \
    case 7: KIND##7 ARGS; break;                                                                          \
    default: KIND##8 ARGS; break;                                                                         \
  }
#elif MR == 3
#define DISPATCH(KIND, mm, ARGS)                                                                            \
  switch (mm) {                                                                                           \
    case 1: KIND##1 ARGS; break;                                                                          \
    case 2: KIND##2 ARGS; break;                                                                          \
    default: KIND##3 ARGS; break;                                                                         \
  }
#else
#define DISPATCH(KIND, mm, ARGS)                                                                            \
  switch (mm) {                                                                                           \
    case 1: KIND##1 ARGS; break;                                                                          \
    default: KIND##2 ARGS; break;                                                                         \
  }
#endif

/* More rows than one tile takes (MR) need several passes over a block. Passes over the whole block, one after the
   other, read it from memory once and from L2 after that, and memory sits idle during the later passes: on this
   project's AVX2 EPYC (3-row tile) an 8-row product cost the 1-row stream plus the 8-row arithmetic, the two
   added instead of overlapped. So rows beyond one tile walk the block in chunks of KC k's (KC * NB weights, 8 KB
   in float32): every pass of up to SUPER rows over one chunk before the next chunk, the later passes reading it
   from L1, so the memory stream runs on under the arithmetic. One tile's rows or fewer (every 1-row forward)
   take the whole K in one pass, as before.
   Every pass over a chunk, the first included, prefetches (into L2) a share of the chunk CHUNK_PREFETCH_AHEAD
   chunks on, spread evenly over the passes' k's: the packed blocks are one stream, so that is the rest of this
   block or the next block's start, and past a product's last block the next product's first weights (the arena
   lays them out in a forward's order; a prefetch never faults, and integer arithmetic forms its address). One
   chunk ahead, a line per k from the second pass on, left the stream idle while the first pass ran and bunched
   the prefetches into the first passes after it. On this project's AVX2 EPYC (Zen 3), whole forwards of the
   embedded model, the two sources interleaved (three runs): 4-8 rows 1.02-1.12x faster, 12-24 rows 1.11-1.20x,
   the same bits; 1-3 rows take one pass and are unchanged. Three chunks ahead measured as two (2026-12-03).
   Each of those prefetches is paired with one into L1 of the same line of the next chunk (already on its way to
   L2), so that the next chunk's first pass, which takes every line of it from the level below L1, finds them
   in L1 like the later passes: on the Zen 3 the model's products, interleaved against the source before, 8-16
   rows 1.04-1.11x faster (three runs; 4-6 rows 0.99-1.17x), whole 4-16-row forwards 1.00-1.10x, the same bits
   (float32 weights; bfloat16 products of 4-24 rows, bound by their widening, within this host's noise, which
   was 10-15% that hour). Not measured on an AVX-512 CPU, where only 9+ rows take this path. */
#define KC 64
#define SUPER (8 * MR)
#define CHUNK_PREFETCH_AHEAD 2

/* A chunk's weights for the chunked passes: NULL, each pass reads the stored weights (float32, or bfloat16 widened
   in registers as in one tile's pass), or, for bfloat16 under WIDEN_ONCE_PASSES passes or more, the chunk widened
   once into buf ([kn][NB] floats, 8 KB: L1), which every pass then reads as floats. Widening in every pass cost
   the AVX2 tile (3 rows a pass, six passes for 16 rows) more than the halved stream saved: widening once made
   16-24 rows 1.2-1.3x faster in five of eight interleaved comparisons (within 5% in the others: this host's
   moments), level with float32, and the SSE2 tile's 8-24 rows 1.1-1.2x (a scratch A/B of the two sources' products, EPYC of
   2026-12-03). With 2-3 passes (AVX2 4-8 rows, AVX-512 16-24 rows) the store and reload cost what they saved. */
#define WIDEN_ONCE_PASSES 4
static inline const float *chunk_weights_f_(const float *pb, int kn, long passes, float *buf) {
  (void)pb, (void)kn, (void)passes, (void)buf;
  return NULL;
}
static inline const float *chunk_weights_h_(const unsigned short *pb, int kn, long passes, float *buf) {
  if (passes < WIDEN_ONCE_PASSES) return NULL;
  for (int k = 0; k < kn; k++)
    for (int j = 0; j < NV; j++) *(vec *)(buf + k * NB + j * VL) = load_bf16(pb + (size_t)k * NB, j);
  return buf;
}

/* The product's blocks, for weights stored as WT (float or bfloat16 bits, SUF f_ or h_): see lp_native_gemm_f32. */
#define GEMM_OF(SUF, WT)                                                                                    \
  static int gemm_##SUF(const float *x, const WT *p, const float *b, float *y, long M, long N, long K,       \
                        int threads) {                                                                    \
    if (M < 1 || N < 1 || K < 1 || threads < 1) return -1;                                                \
    long blocks = (N + NB - 1) / NB;                                                                      \
    _Pragma("omp parallel for num_threads(threads) schedule(static)") for (long blk = 0; blk < blocks; blk++) { \
      float acc[SUPER * NB] __attribute__((aligned(64))), wbuf[KC * NB] __attribute__((aligned(64)));     \
      long n = blk * NB;                                                                                  \
      int ncols = N - n < NB ? (int)(N - n) : NB;                                                         \
      const WT *pb = p + (size_t)blk * K * NB;                                                            \
      if (M <= MR) { /* one tile: one pass over the whole K */                                            \
        DISPATCH(whole_##SUF, (int)M, (x, pb, y + n, (int)N, (int)K, ncols))                              \
      } else                                                                                              \
        for (long s0 = 0; s0 < M; s0 += SUPER) {                                                          \
          long rows = M - s0 < SUPER ? M - s0 : SUPER, passes = (rows + MR - 1) / MR;                     \
          for (long k0 = 0; k0 < K; k0 += KC) {                                                           \
            int kn = K - k0 < KC ? (int)(K - k0) : KC, first = k0 == 0;                                   \
            /* the chunk CHUNK_PREFETCH_AHEAD on in the stream: its lines spread evenly over the passes' k's */ \
            size_t ahead_at = (size_t)(k0 + CHUNK_PREFETCH_AHEAD * KC) * NB * sizeof(WT);                 \
            size_t to_near = (CHUNK_PREFETCH_AHEAD - 1) * (size_t)KC * NB * sizeof(WT); /* ahead -> next */ \
            const char *ahead = (const char *)((uintptr_t)pb + ahead_at);                                 \
            int lines = (int)((size_t)KC * NB * sizeof(WT) / 64), its = (int)passes * kn;                 \
            const float *cw = chunk_weights_##SUF(pb + (size_t)k0 * NB, kn, passes, wbuf);                \
            for (long m0 = 0, pass = 0; m0 < rows; m0 += MR, pass++) {                                    \
              int mm = rows - m0 < MR ? (int)(rows - m0) : MR;                                            \
              long done = pass * kn * lines; /* the earlier passes' k's: done / its lines prefetched */   \
              const char *pf = ahead + (size_t)(done / its) * 64;                                         \
              const char *near = (const char *)((uintptr_t)pf - to_near);                             \
              int phase = (int)(done % its);                                                              \
              const float *xs = x + (size_t)(s0 + m0) * K + k0;                                           \
              if (cw)                                                                                     \
                DISPATCH(chunk_f_, mm, (xs, cw, acc + m0 * NB, (int)K, kn, first, pf, near, lines, its, phase)) \
              else                                                                                        \
                DISPATCH(chunk_##SUF, mm,                                                                 \
                         (xs, pb + (size_t)k0 * NB, acc + m0 * NB, (int)K, kn, first, pf, near, lines, its, phase))\
            }                                                                                             \
          }                                                                                               \
          for (long m = 0; m < rows; m++)                                                                 \
            memcpy(y + (size_t)(s0 + m) * N + n, acc + m * NB, sizeof(float) * (size_t)ncols);            \
        }                                                                                                 \
      if (b)                                                                                              \
        for (long m = 0; m < M; m++)                                                                      \
          for (int c = 0; c < ncols; c++) y[(size_t)m * N + n + c] += b[n + c];                           \
    }                                                                                                     \
    return 0;                                                                                             \
  }
GEMM_OF(f_, float)
GEMM_OF(h_, unsigned short)

/* x [M, K], p packed [ceil(N/NB), K, NB], b [N] or NULL, y [M, N]; all float32, contiguous. 0, or -1 on bad sizes. */
int lp_native_gemm_f32(const float *x, const float *p, const float *b, float *y, long M, long N, long K,
                       int threads) {
  return gemm_f_(x, p, b, y, M, N, K, threads);
}

/* lp_native_gemm_f32 with p's weights stored as bfloat16 bits (uint16, the same layout): the float32 product on
   those weights widened, bit for bit. */
int lp_native_gemm_bf16w(const float *x, const unsigned short *p, const float *b, float *y, long M, long N, long K,
                         int threads) {
  return gemm_h_(x, p, b, y, M, N, K, threads);
}

typedef float v8 __attribute__((vector_size(32), aligned(4)));
typedef float v4 __attribute__((vector_size(16), aligned(4)));

/* The sum of a vector's 16 lanes as a tree (depth 4, not a chain of 16 dependent adds). */
static inline float hsum16(v16 a) {
  v8 lo, hi;
  memcpy(&lo, &a, sizeof lo);
  memcpy(&hi, (const char *)&a + sizeof lo, sizeof hi);
  v8 s8 = lo + hi;
  v4 l4, h4;
  memcpy(&l4, &s8, sizeof l4);
  memcpy(&h4, (const char *)&s8 + sizeof l4, sizeof h4);
  v4 s4 = l4 + h4;
  return (s4[0] + s4[2]) + (s4[1] + s4[3]);
}

typedef int veci __attribute__((vector_size(VL * 4), aligned(4)));
typedef int v16i __attribute__((vector_size(64), aligned(4)));

/* The attention works on 16-lane groups (16 keys' scores, 16 floats of a head) held as P16 native vectors,
   lanes u * VL .. of the group in part u. Its arithmetic is lane by lane and its sums are hsum16's tree, so
   every instruction set computes the same bits. (GCC's 16-lane vectors on a target without them go through
   the stack lane by lane for every scalar operand: the attention built for AVX2 that way ran 6x slower.) */
#define P16 (16 / VL)

/* hsum16 of the 16 lanes held as P16 native parts: the same additions in the same order. */
static inline float hsum_parts(const vec *p) {
#if VL == 16
  return hsum16(p[0]);
#else
#if VL == 8
  v4 l4, h4;
  vec s8 = p[0] + p[1];
  memcpy(&l4, &s8, sizeof l4);
  memcpy(&h4, (const char *)&s8 + sizeof l4, sizeof h4);
  v4 s4 = l4 + h4;
#else
  v4 s4 = (p[0] + p[2]) + (p[1] + p[3]);
#endif
  return (s4[0] + s4[2]) + (s4[1] + s4[3]);
#endif
}

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

/* Sixteen sources' lane sums at once (lane l of part u of out: hsum_parts of source u * VL + l), by a
   transpose-and-add tree instead of 16 horizontal sums: each source's lanes are added in hsum16's order whatever
   its neighbours hold, so the bits are hsum_parts' on every instruction set. AVX-512: 15 shuffle-add steps for
   the 16. AVX2: per 8 sources, a vertical add of the two halves, then pairs of sources (k, k + 4) trade 128-bit
   halves, quads trade pairs and the last step adds neighbours, landing source k in lane k; 4-float vectors alike
   with one step fewer. (16 hsum_parts, each extracting and adding down to a scalar, then the scale and the mask
   applied key by key: the AVX2 build's 8- and 16-row attention 1.11x slower on one thread, this project's Zen 3.) */
static inline void sum16_parts(const vec (*p)[P16], vec *out) {
#if VL == 16
  const v16i lo8 = {0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23};
  const v16i hi8 = {8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31};
  const v16i lo4 = {0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27};
  const v16i hi4 = {4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31};
  const v16i lo2 = {0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29};
  const v16i hi2 = {2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27, 30, 31};
  const v16i lo1 = {0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30};
  const v16i hi1 = {1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31};
  v16 a[8], b[4], c[2];
  for (int m = 0; m < 8; m++)
    a[m] = __builtin_shuffle(p[2 * m][0], p[2 * m + 1][0], lo8) + __builtin_shuffle(p[2 * m][0], p[2 * m + 1][0], hi8);
  for (int m = 0; m < 4; m++)
    b[m] = __builtin_shuffle(a[2 * m], a[2 * m + 1], lo4) + __builtin_shuffle(a[2 * m], a[2 * m + 1], hi4);
  for (int m = 0; m < 2; m++)
    c[m] = __builtin_shuffle(b[2 * m], b[2 * m + 1], lo2) + __builtin_shuffle(b[2 * m], b[2 * m + 1], hi2);
  out[0] = __builtin_shuffle(c[0], c[1], lo1) + __builtin_shuffle(c[0], c[1], hi1);
#elif VL == 8
  const veci lo4 = {0, 1, 2, 3, 8, 9, 10, 11}, hi4 = {4, 5, 6, 7, 12, 13, 14, 15};
  const veci lo2 = {0, 1, 8, 9, 4, 5, 12, 13}, hi2 = {2, 3, 10, 11, 6, 7, 14, 15};
  const veci lo1 = {0, 2, 8, 10, 4, 6, 12, 14}, hi1 = {1, 3, 9, 11, 5, 7, 13, 15};
  for (int g = 0; g < 2; g++) {
    const vec(*q)[P16] = p + 8 * g;
    vec a[4], b[2];
    for (int m = 0; m < 4; m++) { /* lanes 0-3: source m's four sums, 4-7: source m + 4's */
      vec x = q[m][0] + q[m][1], y = q[m + 4][0] + q[m + 4][1];
      a[m] = __builtin_shuffle(x, y, lo4) + __builtin_shuffle(x, y, hi4);
    }
    for (int m = 0; m < 2; m++) /* sources 2m, 2m + 1, 2m + 4, 2m + 5: two sums each */
      b[m] = __builtin_shuffle(a[2 * m], a[2 * m + 1], lo2) + __builtin_shuffle(a[2 * m], a[2 * m + 1], hi2);
    out[g] = __builtin_shuffle(b[0], b[1], lo1) + __builtin_shuffle(b[0], b[1], hi1);
  }
#else
  const veci lo2 = {0, 1, 4, 5}, hi2 = {2, 3, 6, 7}, lo1 = {0, 2, 4, 6}, hi1 = {1, 3, 5, 7};
  for (int g = 0; g < 4; g++) {
    const vec(*q)[P16] = p + 4 * g;
    vec a[2];
    for (int m = 0; m < 2; m++) { /* sources 2m, 2m + 1: two sums each */
      vec x = (q[2 * m][0] + q[2 * m][2]) + (q[2 * m][1] + q[2 * m][3]);
      vec y = (q[2 * m + 1][0] + q[2 * m + 1][2]) + (q[2 * m + 1][1] + q[2 * m + 1][3]);
      a[m] = __builtin_shuffle(x, y, lo2) + __builtin_shuffle(x, y, hi2);
    }
    out[g] = __builtin_shuffle(a[0], a[1], lo1) + __builtin_shuffle(a[0], a[1], hi1);
  }
#endif
}

#define RB 4 /* packed rows per task (one K/V head) */

/* The scores of up to RB rows over keys [0, end), 16 keys at a time: each key is loaded once for all the rows, each
   row's dot product is the same expression whatever rows share the task (DV = D / 16 <= 16 groups a slot). */
static inline __attribute__((always_inline)) void scores_shared(const float *const *qr, const float *const *mr, int rb,
                                                                const float *kh, long open, long end, float scale,
                                                                float *s, long stride, const int DV) {
  for (long j0 = 0; j0 < end; j0 += 16) {
    int nj = end - j0 < 16 ? (int)(end - j0) : 16;
    int seen = j0 + 16 <= open; /* all 16 keys visible to every row: no mask reads */
    vec partial[RB][16][P16];
    for (int l = 0; l < 16; l++) {
      vec kc[16 * P16];
      if (l < nj)
        for (int c = 0; c < DV * P16; c++) kc[c] = *(const vec *)(kh + (size_t)(j0 + l) * DV * 16 + VL * c);
      for (int i = 0; i < RB; i++) {
        if (i < rb && (seen || (l < nj && mr[i][j0 + l] > -1e30f))) {
          for (int u = 0; u < P16; u++) { /* from zero: each add has one product to fuse, whatever unrolls */
            vec acc = (vec){0};
            for (int c = 0; c < DV; c++) acc += *(const vec *)(qr[i] + 16 * c + VL * u) * kc[c * P16 + u];
            partial[i][l][u] = acc;
          }
        } else {
          for (int u = 0; u < P16; u++) partial[i][l][u] = (vec){0};
        }
      }
    }
    for (int i = 0; i < rb; i++) {
      vec dots[P16];
      sum16_parts(partial[i], dots);
      float *si = s + i * stride;
      if (seen)
        for (int u = 0; u < P16; u++)
          *(vec *)(si + j0 + VL * u) = dots[u] * scale + *(const vec *)(mr[i] + j0 + VL * u);
      else
        for (int l = 0; l < nj; l++) {
          float m = mr[i][j0 + l];
          si[j0 + l] = m > -1e30f ? dots[l / VL][l % VL] * scale + m : -__builtin_inff();
        }
    }
  }
}

/* Accumulators values_shared keeps in registers: G rows x D / VL vectors (16 of AVX-512's 32 registers, 8 of
   AVX2's or SSE's 16; the values are memory operands). */
#if VL == 16
#define ACC_VECS 16
#else
#define ACC_VECS 8
#endif
#define VALUE_ROWS(DV) ((DV) * P16 >= ACC_VECS ? 1 : ACC_VECS / ((DV) * P16) > RB ? RB : ACC_VECS / ((DV) * P16))

/* The values values_shared weighs in one block of keys, all the task's rows over it before the next block: 8 KB,
   so the block stays in L1 while the rows pass over it and each value comes from L2 once per task. (A head's
   values over a few hundred keys are 100+ KB; streamed whole per row, the AVX2 build's weighing, one row at a
   time, ran at L2's bandwidth, about one multiply-add a cycle: its 8- and 16-row attention 1.19x slower on one
   thread, this project's Zen 3. 4 KB and 16 KB blocks measured the same as 8.) */
#define VALUE_BLOCK_BYTES 8192

/* o_i = inv_i * sum_j w_i[j] v_j over the keys row i sees (j < end), in increasing j, for up to RB rows: per block
   of keys, G rows at a time with their sums in registers (each value loaded once for G rows), the sums kept in
   memory between blocks (stored and reloaded exactly: the same additions in the same order as one pass). */
static inline __attribute__((always_inline)) void values_shared(float *const *o, const float *s, long stride,
                                                                const float *const *mr, int rb, const float *vh,
                                                                long open, long end, const float *inv, const int DV,
                                                                const int G) {
  const long block = VALUE_BLOCK_BYTES / (DV * 64) > 1 ? VALUE_BLOCK_BYTES / (DV * 64) : 1;
  vec kept[RB][16 * P16];
  for (int i = 0; i < rb; i++)
    for (int c = 0; c < DV * P16; c++) kept[i][c] = (vec){0};
  for (long j0 = 0; j0 < end; j0 += block) {
    long j1 = j0 + block < end ? j0 + block : end;
    long seen = open < j1 ? open : j1; /* keys [j0, seen) every row sees */
    for (int i0 = 0; i0 < rb; i0 += G) {
      vec acc[RB][16 * P16];
      for (int i = 0; i < G; i++)
        if (i0 + i < rb)
          for (int c = 0; c < DV * P16; c++) acc[i][c] = kept[i0 + i][c];
      for (long j = j0; j < seen; j++) { /* no mask reads */
        const float *vj = vh + (size_t)j * DV * 16;
        for (int i = 0; i < G; i++)
          if (i0 + i < rb) {
            float w = s[(i0 + i) * stride + j];
            for (int c = 0; c < DV * P16; c++) acc[i][c] += w * *(const vec *)(vj + VL * c);
          }
      }
      for (long j = seen > j0 ? seen : j0; j < j1; j++) {
        const float *vj = vh + (size_t)j * DV * 16;
        for (int i = 0; i < G; i++)
          if (i0 + i < rb && mr[i0 + i][j] > -1e30f) {
            float w = s[(i0 + i) * stride + j];
            for (int c = 0; c < DV * P16; c++) acc[i][c] += w * *(const vec *)(vj + VL * c);
          }
      }
      for (int i = 0; i < G; i++)
        if (i0 + i < rb)
          for (int c = 0; c < DV * P16; c++) kept[i0 + i][c] = acc[i][c];
    }
  }
  for (int i = 0; i < rb; i++)
    for (int c = 0; c < DV * P16; c++) *(vec *)(o[i] + VL * c) = kept[i][c] * inv[i];
}

/* The rows of one call that share a K/V region: the generations of a batched round (lp_runner/batch_forward.py).
   Segment b holds round rows [start[b], start[b + 1]); its key j is slot base[b] + j of the buffer, for j below
   width[b]; its mask rows are width[b] floats each, at mask + moff[b], its rows in order. No row of a segment
   reads another segment's keys or mask. A plain round is one segment: rows [0, Q), base 0, width C, offset 0. */
struct segments {
  long n;
  const long *start, *base, *width, *moff;
};

/* The sizes of a segment table: rows [0, Q) covered in order, each region inside the C slots. */
static int segments_ok(const struct segments *sg, long Q, long C) {
  if (sg->n < 1 || sg->start[0] != 0 || sg->start[sg->n] != Q) return 0;
  for (long b = 0; b < sg->n; b++)
    if (sg->start[b + 1] <= sg->start[b] || sg->base[b] < 0 || sg->width[b] < 1 || sg->moff[b] < 0 ||
        sg->base[b] + sg->width[b] > C)
      return 0;
  return 1;
}

/* lp_native_attention_f32 over segments (see there): each task is up to RB packed rows of one segment and one
   head, so a task's rows share their keys, and a row's arithmetic is the one a call of its segment alone gives
   (its keys at the same offsets from the segment's base, the same mask row): bit for bit. With one segment the
   tasks are the plain call's. G = M / Q query heads per K/V head (any M with one segment). */
static int attention_segments(const float *q, const float *k, const float *v, const float *mask, float *out, long H,
                              long M, long Q, long D, long ks, long vs, float scale, int threads,
                              const struct segments *sg) {
  long nseg = sg->n, G = M / Q;
  if (nseg > 1 && M % Q) return -1;
  long wmax = 0;
  for (long b = 0; b < nseg; b++) wmax = sg->width[b] > wmax ? sg->width[b] : wmax;
  long stride = (wmax + 15) & ~15L;
  /* Per mask row: its mask, its segment, keys [0, open) all visible, none at or past end (a prefix and a bound
     every task of that row shares, found once per call instead of once per task). Per segment: its first task. */
  long *open_at = malloc(sizeof(long) * (3 * (size_t)Q + (size_t)nseg + 1));
  const float **mrow = malloc(sizeof(float *) * (size_t)Q);
  if (!open_at || !mrow) {
    free(open_at), free(mrow);
    return -2;
  }
  long *end_at = open_at + Q, *seg_of = end_at + Q, *first_task = seg_of + Q;
  first_task[0] = 0;
  for (long b = 0; b < nseg; b++) {
    long rows = sg->start[b + 1] - sg->start[b], packed = nseg == 1 ? M : G * rows, C = sg->width[b];
    first_task[b + 1] = first_task[b] + (packed + RB - 1) / RB;
    for (long r = sg->start[b]; r < sg->start[b + 1]; r++) {
      const float *mq = mask + sg->moff[b] + (size_t)(r - sg->start[b]) * C;
      long j = 0;
      while (j < C && mq[j] > -1e30f) j++;
      open_at[r] = j;
      for (j = C; j > open_at[r] && !(mq[j - 1] > -1e30f); j--) {
      }
      end_at[r] = j;
      mrow[r] = mq;
      seg_of[r] = b;
    }
  }
  long per_head = first_task[nseg];
  int failed = 0;
#pragma omp parallel num_threads(threads)
  {
    float *s = (float *)aligned_alloc(64, sizeof(float) * (size_t)(RB * stride));
    if (!s) {
#pragma omp atomic write
      failed = 1;
    }
#pragma omp for schedule(static)
    for (long t = 0; t < H * per_head; t++) {
      if (!s) continue;
      long h = t / per_head, task = t % per_head, b = 0;
      while (first_task[b + 1] <= task) b++;
      long rows = sg->start[b + 1] - sg->start[b], packed = nseg == 1 ? M : G * rows;
      long r0 = (task - first_task[b]) * RB;
      int rb = packed - r0 < RB ? (int)(packed - r0) : RB;
      const float *kh = k + (size_t)h * ks + (size_t)sg->base[b] * D, *vh = v + (size_t)h * vs + (size_t)sg->base[b] * D;
      const float *qr[RB], *mr[RB];
      float *o[RB];
      long end = 0, open = sg->width[b]; /* one past the last key any row sees; keys below open every row sees */
      for (int i = 0; i < rb; i++) {
        long idx = r0 + i, row = sg->start[b] + idx % rows, r = (idx / rows) * Q + row; /* packed row, mask row */
        qr[i] = q + ((size_t)h * M + r) * D;
        mr[i] = mrow[row];
        o[i] = out + ((size_t)h * M + r) * D;
        end = end_at[row] > end ? end_at[row] : end;
        open = open_at[row] < open ? open_at[row] : open;
      }
      open = open < end ? open : end;
      long span = (end + 15) & ~15L;
      int shared = D % 16 == 0 && D <= 256; /* vector slots: keys and values loaded once per task */
      if (D == 64)
        scores_shared(qr, mr, rb, kh, open, end, scale, s, stride, 4);
      else if (D == 128)
        scores_shared(qr, mr, rb, kh, open, end, scale, s, stride, 8);
      else if (shared)
        scores_shared(qr, mr, rb, kh, open, end, scale, s, stride, (int)(D / 16));
      else
        for (int i = 0; i < rb; i++) {
          float *si = s + i * stride;
          for (long j = 0; j < end; j++) {
            const float *kj = kh + (size_t)j * D;
            float m = mr[i][j];
            if (m <= -1e30f) {
              si[j] = -__builtin_inff();
              continue;
            }
            float dot = 0.f;
            for (long d = 0; d < D; d++) dot += qr[i][d] * kj[d];
            si[j] = dot * scale + m;
          }
        }
      float inv[RB];
      for (int i = 0; i < rb; i++) {
        float *si = s + i * stride;
        for (long j = end; j < span; j++) si[j] = -__builtin_inff();
        vec top = (vec){0} - __builtin_inff(); /* the row's largest score, VL lanes at a time (max is exact) */
        for (long j = 0; j < span; j += VL) {
          vec x = *(const vec *)(si + j);
          veci more = x > top;
          top = (vec)(((veci)x & more) | ((veci)top & ~more));
        }
        float best = -__builtin_inff();
        for (int l = 0; l < VL; l++) best = top[l] > best ? top[l] : best;
        vec total[P16];
        for (int u = 0; u < P16; u++) total[u] = (vec){0};
        if (best > -__builtin_inff())
          for (long j = 0; j < span; j += 16)
            for (int u = 0; u < P16; u++) {
              vec e = expv(*(vec *)(si + j + VL * u) - best);
              *(vec *)(si + j + VL * u) = e;
              total[u] += e;
            }
        float sum = hsum_parts(total);
        inv[i] = sum > 0.f ? 1.f / sum : 0.f;
      }
      if (D == 64)
        values_shared(o, s, stride, mr, rb, vh, open, end, inv, 4, VALUE_ROWS(4));
      else if (D == 128)
        values_shared(o, s, stride, mr, rb, vh, open, end, inv, 8, VALUE_ROWS(8));
      else if (shared)
        values_shared(o, s, stride, mr, rb, vh, open, end, inv, (int)(D / 16), VALUE_ROWS(D / 16));
      else
        for (int i = 0; i < rb; i++) {
          const float *si = s + i * stride;
          for (long d = 0; d < D; d++) o[i][d] = 0.f;
          for (long j = 0; j < end; j++)
            if (mr[i][j] > -1e30f)
              for (long d = 0; d < D; d++) o[i][d] += si[j] * vh[(size_t)j * D + d];
          for (long d = 0; d < D; d++) o[i][d] *= inv[i];
        }
    }
    free(s);
  }
  free(open_at), free(mrow);
  return failed ? -2 : 0;
}

/* Attention of a few packed rows over a K/V buffer (lp_runner/attention.py, with the native product).

   q [H, M, D]: the M = groups x Q packed query rows of each K/V head h (row r reads the mask of round row r % Q);
   k, v [H, C, D]: the cache's first C slots, head h at k + h * ks (v + h * vs), each slot D contiguous floats;
   mask [Q, C] additive (0 visible; a key at or below -1e30 hidden);
   out [H, M, D]. Per (h, r): s_j = (q . k_j) * scale + mask_j over the visible keys only, softmax, sum_j p_j v_j.

   A task is up to RB rows of one head; for heads of a multiple of 16 floats, up to 256, each key and each value is
   loaded once for all of them (scores_shared, values_shared). Per row, 16 keys' scores at a time (their dot
   products summed across lanes by one tree, sum16_parts), a vector exp, and the weighted sum of values in
   registers, block of keys by block. The keys every row
   of a task sees (a round's cached prefix: most keys) are scored and weighed without reading the mask per key;
   the others are checked key by key. Hidden keys are never scored or weighed (a static cache's spare slots may
   hold anything; keys past the last visible one are not visited at all), a hidden key weighs exactly 0, as in
   any fp32 softmax, and every row's arithmetic is the same expression in the same order whatever rows share its
   task: a row's result does not depend on the rows beside it (the product's guarantee, kept).
   A row that sees no key gets zeros. */
int lp_native_attention_f32(const float *q, const float *k, const float *v, const float *mask, float *out, long H,
                            long M, long Q, long C, long D, long ks, long vs, float scale, int threads) {
  if (H < 1 || M < 1 || Q < 1 || C < 1 || D < 1 || threads < 1) return -1;
  const long start[2] = {0, Q}, base = 0, moff = 0;
  const struct segments one = {1, start, &base, &C, &moff};
  return attention_segments(q, k, v, mask, out, H, M, Q, D, ks, vs, scale, threads, &one);
}

/* lp_native_attention_f32 with the round's rows in nseg segments (struct segments: start [nseg + 1], base, width,
   moff [nseg]) over one K/V buffer of C slots, M = G x Q packed rows per head. 0; -1 bad sizes; -2 out of memory. */
int lp_native_attention_segments_f32(const float *q, const float *k, const float *v, const float *mask, float *out,
                                     long H, long M, long Q, long C, long D, long ks, long vs, float scale,
                                     int threads, long nseg, const long *start, const long *base, const long *width,
                                     const long *moff) {
  const struct segments sg = {nseg, start, base, width, moff};
  if (H < 1 || M < 1 || Q < 1 || C < 1 || D < 1 || threads < 1 || !segments_ok(&sg, Q, C)) return -1;
  return attention_segments(q, k, v, mask, out, H, M, Q, D, ks, vs, scale, threads, &sg);
}

/* The layer's row-wise steps (norms, rotary and head layout, SiLU, residual adds) share the rows out over the
   threads from this many rows on: a 64-token prefill of the embedded model spent 10% of its time in them on one
   thread. Below it the threads' start and join cost what they save (measured at 8 rows: 23.31 against 23.32 ms).
   Each row's arithmetic is the same on any thread. */
#define ROWWISE_PARALLEL_ROWS 16

/* for (long i = 0; i < R; i++) the statement, the rows shared out over the threads from ROWWISE_PARALLEL_ROWS rows
   on; below, no OpenMP region at all (a region of one thread still costs its entry and exit, 30 layers x 7 steps
   of them a forward). */
#define FOR_ROWS(i, R, threads, ...)                                                                        \
  do {                                                                                                    \
    if ((R) >= ROWWISE_PARALLEL_ROWS && (threads) > 1) {                                                  \
      _Pragma("omp parallel for num_threads(threads) schedule(static)") for (long i = 0; i < (R); i++) {  \
        __VA_ARGS__;                                                                                      \
      }                                                                                                   \
    } else                                                                                                \
      for (long i = 0; i < (R); i++) {                                                                    \
        __VA_ARGS__;                                                                                      \
      }                                                                                                   \
  } while (0)

/* SiLU(g) * u per element, VL lanes at a time: g / (1 + e^-g) * u written as (g >= 0 ? g : g * e) / (1 + e) * u
   with e = e^-|g| (expv's range, so no overflow), which for g >= 0 is the scalar expression itself; within 3 ulp
   of the exact value (torch's: 2), and exactly -0 where g < -87.3 (the exact value is below 1e-36). A scalar libm
   expf per element took 1.4-3.7 ms of a 27-31 ms 8-row forward of the embedded model in a timing harness (this
   project's EPYC; it varied with the activations); this takes about 0.2 ms. Lane by lane, a partial last vector
   through a zero-padded copy: every instruction set with FMA gives the same bits, and an element's value does not
   depend on its neighbours. */
static inline vec silu_times(vec g, vec u) {
  veci pos = g >= 0.f;
  vec e = expv((vec)(((veci)((vec){0} - g) & pos) | ((veci)g & ~pos))); /* e^-|g| */
  vec num = (vec)(((veci)g & pos) | ((veci)(g * e) & ~pos));
  return num / (1.f + e) * u;
}

static void silu_gate_row(const float *g, const float *u, float *out, long I) {
  long j = 0;
  for (; j + VL <= I; j += VL) /* plain vector loads: GCC built memcpy's for AVX2 as two 16-byte halves stored to
                                  the stack and read back whole (a failed store forward per vector: 7x slower) */
    *(vec *)(out + j) = silu_times(*(const vec *)(g + j), *(const vec *)(u + j));
  if (j < I) {
    float a[VL] = {0}, b[VL] = {0}, r[VL];
    memcpy(a, g + j, sizeof(float) * (size_t)(I - j));
    memcpy(b, u + j, sizeof(float) * (size_t)(I - j));
    vec va, vb;
    memcpy(&va, a, sizeof va);
    memcpy(&vb, b, sizeof vb);
    vec vr = silu_times(va, vb);
    memcpy(r, &vr, sizeof r);
    memcpy(out + j, r, sizeof(float) * (size_t)(I - j));
  }
}

/* act [R, I] = SiLU(gate) * up of gu [R, 2I] (each row: I gate values, then I up values: the stacked gate/up
   product's layout). 0, or -1 on bad sizes. */
static void silu_gate_rows(const float *gu, float *act, long R, long I, int threads) {
  FOR_ROWS(i, R, threads, silu_gate_row(gu + (size_t)i * 2 * I, gu + (size_t)i * 2 * I + I, act + (size_t)i * I, I));
}

int lp_native_silu_gate_f32(const float *gu, float *act, long R, long I) {
  if (R < 1 || I < 1) return -1;
  silu_gate_rows(gu, act, R, I, 1);
  return 0;
}

/* One decoder layer of the Llama family (Llama, Mistral, Qwen2: pre-norm RMSNorm, rotary q/k in the rotate-half
   convention, grouped-query attention over a K/V buffer, SiLU-gated MLP) on R rows, in one call, so that a
   forward of a few rows pays one call per layer instead of some twenty small ops (native_layers.py says why).
   h [R, E] is the residual stream, updated in place. Products are lp_native_gemm_f32 on the packed weights
   (q/k/v stacked, gate/up stacked); attention is lp_native_attention_f32 on the query heads packed per K/V
   head (row g*R + i of K/V head kv is query head kv*G + g of row i). The round's K and V (after rotary) are
   written at slots[i] of kbuf / vbuf ([Hkv, slots, D], head strides ks / vs) before attention reads them.
   cos / sin [R, D]: the model's rotary embedding at each row's position. mask [R, C] additive over the C slots.
   Each element is computed as transformers' eager expression computes it, up to the order of float sums.
   0; -1 bad sizes; -2 out of memory. */

typedef float vf8 __attribute__((vector_size(32), aligned(4)));
typedef double vd8 __attribute__((vector_size(64), aligned(8)));

/* y = w * (x * inv) per row, inv = 1 / sqrt(mean(x^2) + eps), the squares summed in double (each square is exact
   there): 16 at a time in two 8-lane sums, added in a fixed tree, then the tail in order. The same bits on every
   instruction set (8 doubles are one AVX-512 vector, two AVX2 ones). Why not one sum in order: its chain of
   dependent double adds cost 6 cycles an element, 2.1 ms of a 64-token prefill of the embedded model. */
static void norm_row(const float *xr, const float *w, float eps, float *yr, long E) {
  vd8 lo = (vd8){0}, hi = (vd8){0};
  long e = 0;
  for (; e + 16 <= E; e += 16) {
    vd8 a = __builtin_convertvector(*(const vf8 *)(xr + e), vd8);
    vd8 b = __builtin_convertvector(*(const vf8 *)(xr + e + 8), vd8);
    lo += a * a, hi += b * b;
  }
  vd8 t = lo + hi;
  double squares = ((t[0] + t[4]) + (t[2] + t[6])) + ((t[1] + t[5]) + (t[3] + t[7]));
  for (; e < E; e++) squares += (double)xr[e] * xr[e];
  float inv = 1.f / sqrtf((float)(squares / E) + eps);
  for (e = 0; e < E; e++) yr[e] = w[e] * (xr[e] * inv);
}

static void rms_norm(const float *x, const float *w, float eps, float *y, long R, long E, int threads) {
  FOR_ROWS(r, R, threads, norm_row(x + (size_t)r * E, w, eps, y + (size_t)r * E, E));
}

/* h += y over R rows of E. */
static void add_rows(float *h, const float *y, long R, long E, int threads) {
  FOR_ROWS(i, R, threads, for (size_t j = (size_t)i * E; j < (size_t)(i + 1) * E; j++) h[j] = h[j] + y[j]);
}

static void rotate(float *x, const float *cos, const float *sin, long D) {
  long half = D / 2;
  float t[512];
  memcpy(t, x, sizeof(float) * (size_t)D);
  for (long d = 0; d < half; d++) x[d] = t[d] * cos[d] + (-t[d + half]) * sin[d];
  for (long d = half; d < D; d++) x[d] = t[d] * cos[d] + t[d - half] * sin[d];
}

/* The product on weights stored as float32 or (bf16) as bfloat16 bits. */
static int gemm_w(const float *x, const void *w, int bf16, const float *b, float *y, long M, long N, long K,
                  int threads) {
  return bf16 ? gemm_h_(x, (const unsigned short *)w, b, y, M, N, K, threads)
              : gemm_f_(x, (const float *)w, b, y, M, N, K, threads);
}

/* The sizes every layer of one model shares, and the round's rows. */
struct shape {
  long C, R, E, H, Hkv, D, I;
};

/* A layer's intermediate values for R rows, allocated once per call (one layer or a whole stack of them). */
struct work {
  float *x, *qkv, *qp, *ao, *gu, *act, *y;
};

static float *scratch(size_t n) { return (float *)aligned_alloc(64, ((n * sizeof(float) + 63) / 64) * 64); }

static void work_free(struct work *w) {
  free(w->x), free(w->qkv), free(w->qp), free(w->ao), free(w->gu), free(w->act), free(w->y);
}

static int work_alloc(struct work *w, const struct shape *s) {
  size_t R = (size_t)s->R, nq = (size_t)(s->H * s->D), nqkv = nq + 2 * (size_t)(s->Hkv * s->D);
  w->x = scratch(R * s->E), w->qkv = scratch(R * nqkv), w->qp = scratch(R * nq), w->ao = scratch(R * nq);
  w->gu = scratch(R * 2 * s->I), w->act = scratch(R * s->I), w->y = scratch(R * s->E);
  if (w->x && w->qkv && w->qp && w->ao && w->gu && w->act && w->y) return 0;
  work_free(w);
  return -2;
}

/* The checks every layer's call would make, made once: sizes, and every K/V slot inside the buffer (refused
   before any write). */
static int shape_ok(const struct shape *s, const long *slots) {
  if (s->R < 1 || s->E < 1 || s->H < 1 || s->Hkv < 1 || s->H % s->Hkv || s->D < 2 || s->D % 2 || s->D > 512 ||
      s->I < 1 || s->C < 1)
    return 0;
  for (long i = 0; i < s->R; i++)
    if (slots[i] < 0 || slots[i] >= s->C) return 0;
  return 1;
}

static int llama_layer(const struct work *w, const struct shape *s, float *h, const float *ln1, const float *ln2,
                       float eps, const void *wqkv, const float *bqkv, const void *wo, const float *bo,
                       const void *wgu, const float *bgu, const void *wd, const float *bd, const float *cos,
                       const float *sin, float *kbuf, float *vbuf, long ks, long vs, const long *slots,
                       const float *mask, const struct segments *sg, float scale, int threads, int bf16) {
  long R = s->R, E = s->E, H = s->H, Hkv = s->Hkv, D = s->D, I = s->I;
  long G = H / Hkv, nq = H * D, nkv = Hkv * D, nqkv = nq + 2 * nkv;
  float *x = w->x, *qkv = w->qkv, *qp = w->qp, *ao = w->ao, *gu = w->gu, *act = w->act, *y = w->y;
  int status;
  rms_norm(h, ln1, eps, x, R, E, threads);
  if ((status = gemm_w(x, wqkv, bf16, bqkv, qkv, R, nqkv, E, threads))) return status;
  FOR_ROWS(i, R, threads, {
    float *row = qkv + (size_t)i * nqkv;
    const float *c = cos + (size_t)i * D, *sn = sin + (size_t)i * D;
    for (long hd = 0; hd < H + Hkv; hd++) rotate(row + hd * D, c, sn, D); /* query heads, then key heads */
    for (long kv = 0; kv < Hkv; kv++) {
      for (long g = 0; g < G; g++)
        memcpy(qp + ((size_t)kv * G * R + g * R + i) * D, row + (kv * G + g) * D, sizeof(float) * (size_t)D);
      memcpy(kbuf + (size_t)kv * ks + (size_t)slots[i] * D, row + nq + kv * D, sizeof(float) * (size_t)D);
      memcpy(vbuf + (size_t)kv * vs + (size_t)slots[i] * D, row + nq + nkv + kv * D, sizeof(float) * (size_t)D);
    }
  });
  if ((status = attention_segments(qp, kbuf, vbuf, mask, ao, Hkv, G * R, R, D, ks, vs, scale, threads, sg)))
    return status;
  /* back to [R, H * D] (query head kv * G + g), into qp: read no more */
  FOR_ROWS(i, R, threads, for (long kv = 0; kv < Hkv; kv++) for (long g = 0; g < G; g++)
               memcpy(qp + (size_t)i * nq + (kv * G + g) * D, ao + ((size_t)kv * G * R + g * R + i) * D,
                      sizeof(float) * (size_t)D));
  if ((status = gemm_w(qp, wo, bf16, bo, y, R, E, nq, threads))) return status;
  add_rows(h, y, R, E, threads);
  rms_norm(h, ln2, eps, x, R, E, threads);
  if ((status = gemm_w(x, wgu, bf16, bgu, gu, R, 2 * I, E, threads))) return status;
  silu_gate_rows(gu, act, R, I, threads);
  if ((status = gemm_w(act, wd, bf16, bd, y, R, E, I, threads))) return status;
  add_rows(h, y, R, E, threads);
  return 0;
}

/* L decoder layers one after the other on h, in one call: what L calls of lp_native_llama_layer compute, bit for
   bit. Layer l's pointers are ptrs[LAYER_PTRS * l ...]: ln1, ln2, wqkv, bqkv, wo, bo, wgu, bgu, wd, bd (a bias may
   be NULL), kbuf, vbuf; its epsilon eps[l], its K/V head strides kv_strides[2l], [2l + 1], its mask masks[l].
   Weights stored as bfloat16 bits where bf16 is set (all four of every layer). The sizes, the rows and the slots
   are shared, and checked before any layer runs. Why: from Python, one call per layer cost a forward of the
   embedded model 35-39 us between two layers' calls, 1.0-1.1 ms of a 15-24 ms forward on this project's EPYC
   (2026-12-03): the interpreter ran from caches the weights' stream had just emptied. The table of pointers is
   built once per cache (native.LayerStack); the intermediate values are allocated once per call.
   0; -1 bad sizes; -2 out of memory. */
#define LAYER_PTRS 12
static int layers_segments(float *h, long L, void *const *ptrs, const float *eps, const long *kv_strides,
                           const float *const *masks, const float *cos, const float *sin, const long *slots, long C,
                           long R, long E, long H, long Hkv, long D, long I, float scale, int threads, int bf16,
                           const struct segments *sg) {
  struct shape s = {C, R, E, H, Hkv, D, I};
  struct work w;
  if (L < 0 || !shape_ok(&s, slots) || !segments_ok(sg, R, C)) return -1;
  for (long b = 0; b < sg->n; b++) /* a row writes its K/V inside its own segment's keys only */
    for (long i = sg->start[b]; i < sg->start[b + 1]; i++)
      if (slots[i] < sg->base[b] || slots[i] >= sg->base[b] + sg->width[b]) return -1;
  if (work_alloc(&w, &s)) return -2;
  int status = 0;
  for (long l = 0; l < L && !status; l++) {
    void *const *p = ptrs + LAYER_PTRS * l;
    status = llama_layer(&w, &s, h, p[0], p[1], eps[l], p[2], p[3], p[4], p[5], p[6], p[7], p[8], p[9], cos, sin,
                         p[10], p[11], kv_strides[2 * l], kv_strides[2 * l + 1], slots, masks[l], sg, scale, threads,
                         bf16);
  }
  work_free(&w);
  return status;
}

int lp_native_llama_layers(float *h, long L, void *const *ptrs, const float *eps, const long *kv_strides,
                           const float *const *masks, const float *cos, const float *sin, const long *slots, long C,
                           long R, long E, long H, long Hkv, long D, long I, float scale, int threads, int bf16) {
  const long start[2] = {0, R}, base = 0, moff = 0;
  const struct segments one = {1, start, &base, &C, &moff};
  return layers_segments(h, L, ptrs, eps, kv_strides, masks, cos, sin, slots, C, R, E, H, Hkv, D, I, scale, threads,
                         bf16, &one);
}

/* lp_native_llama_layers over a batched round (lp_runner/batch_forward.py): the rows of nseg generations, each
   with its own region of the K/V buffers and its own mask rows (struct segments; masks[l] holds every segment's
   rows at the offsets moff), in one call, so the products read each weight once for every generation's rows.
   Every row's K/V slot must lie inside its segment's keys. A row's values are those of its segment's rows run
   alone (the products, norms and attention do not depend on the rows beside a row), bit for bit.
   0; -1 bad sizes; -2 out of memory. */
int lp_native_llama_layers_segments(float *h, long L, void *const *ptrs, const float *eps, const long *kv_strides,
                                    const float *const *masks, const float *cos, const float *sin, const long *slots,
                                    long C, long R, long E, long H, long Hkv, long D, long I, float scale,
                                    int threads, int bf16, long nseg, const long *start, const long *base,
                                    const long *width, const long *moff) {
  const struct segments sg = {nseg, start, base, width, moff};
  return layers_segments(h, L, ptrs, eps, kv_strides, masks, cos, sin, slots, C, R, E, H, Hkv, D, I, scale, threads,
                         bf16, &sg);
}

/* One layer: the stacked call above with L = 1 (its checks, its buffers, its code). */
static int one_layer(float *h, const float *ln1, const float *ln2, float eps, const void *wqkv, const float *bqkv,
                     const void *wo, const float *bo, const void *wgu, const float *bgu, const void *wd,
                     const float *bd, const float *cos, const float *sin, float *kbuf, float *vbuf, long ks, long vs,
                     const long *slots, const float *mask, long C, long R, long E, long H, long Hkv, long D, long I,
                     float scale, int threads, int bf16) {
  void *const ptrs[LAYER_PTRS] = {(void *)ln1, (void *)ln2, (void *)wqkv, (void *)bqkv, (void *)wo, (void *)bo,
                                  (void *)wgu, (void *)bgu, (void *)wd, (void *)bd, kbuf, vbuf};
  const long kv_strides[2] = {ks, vs};
  return lp_native_llama_layers(h, 1, ptrs, &eps, kv_strides, &mask, cos, sin, slots, C, R, E, H, Hkv, D, I, scale,
                                threads, bf16);
}

int lp_native_llama_layer(float *h, const float *ln1, const float *ln2, float eps, const float *wqkv,
                          const float *bqkv, const float *wo, const float *bo, const float *wgu, const float *bgu,
                          const float *wd, const float *bd, const float *cos, const float *sin, float *kbuf,
                          float *vbuf, long ks, long vs, const long *slots, const float *mask, long C, long R, long E,
                          long H, long Hkv, long D, long I, float scale, int threads) {
  return one_layer(h, ln1, ln2, eps, wqkv, bqkv, wo, bo, wgu, bgu, wd, bd, cos, sin, kbuf, vbuf, ks, vs, slots, mask,
                   C, R, E, H, Hkv, D, I, scale, threads, 0);
}

/* lp_native_llama_layer with the four packed weights stored as bfloat16 bits (lp_native_gemm_bf16w). */
int lp_native_llama_layer_bf16w(float *h, const float *ln1, const float *ln2, float eps, const unsigned short *wqkv,
                                const float *bqkv, const unsigned short *wo, const float *bo,
                                const unsigned short *wgu, const float *bgu, const unsigned short *wd,
                                const float *bd, const float *cos, const float *sin, float *kbuf, float *vbuf,
                                long ks, long vs, const long *slots, const float *mask, long C, long R, long E, long H,
                                long Hkv, long D, long I, float scale, int threads) {
  return one_layer(h, ln1, ln2, eps, wqkv, bqkv, wo, bo, wgu, bgu, wd, bd, cos, sin, kbuf, vbuf, ks, vs, slots, mask,
                   C, R, E, H, Hkv, D, I, scale, threads, 1);
}
