/* lp_runner's native fp32 product for CPU forwards (backends/cpu/native.py builds and loads it).

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
#include "lp_native.h"

/* The weights' storage: float32, or bfloat16 (model.backend=native-bf16): the upper half of a float32, so a
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
   passes read L1) ran load-bound; now 11 loads. Products of the embedded model's linears, AVX2 build on an
   AVX-512 CPU, interleaved A/B of the two sources: 12-24 rows 1.19-1.25x faster, 4 rows 1.05x, 1-3 and
   8 rows within noise. Holding three spends the last register and measured the same; four spilled
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
   minute on an AVX-512 CPU, the arithmetic no longer hidden under the stream; in six interleaved
   comparisons the plain pass's slow moments cost 26.7 and 28.5 ms against 18.5 and 20.3 with the prefetch, and
   the whole 8-row forward ran 1.02-1.15x faster in three A/B runs. It lowers the 8-row cost; the
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
   other, read it from memory once and from L2 after that, and memory sits idle during the later passes: on an
   AVX2 CPU (3-row tile) an 8-row product cost the 1-row stream plus the 8-row arithmetic, the two
   added instead of overlapped. So rows beyond one tile walk the block in chunks of KC k's (KC * NB weights, 8 KB
   in float32): every pass of up to SUPER rows over one chunk before the next chunk, the later passes reading it
   from L1, so the memory stream runs on under the arithmetic. One tile's rows or fewer (every 1-row forward)
   take the whole K in one pass, as before.
   Every pass over a chunk, the first included, prefetches (into L2) a share of the chunk CHUNK_PREFETCH_AHEAD
   chunks on, spread evenly over the passes' k's: the packed blocks are one stream, so that is the rest of this
   block or the next block's start, and past a product's last block the next product's first weights (the arena
   lays them out in a forward's order; a prefetch never faults, and integer arithmetic forms its address). One
   chunk ahead, a line per k from the second pass on, left the stream idle while the first pass ran and bunched
   the prefetches into the first passes after it. On an AVX2 CPU, whole forwards of the
   embedded model, the two sources interleaved (three runs): 4-8 rows 1.02-1.12x faster, 12-24 rows 1.11-1.20x,
   the same bits; 1-3 rows take one pass and are unchanged. Three chunks ahead measured as two.
   Each of those prefetches is paired with one into L1 of the same line of the next chunk (already on its way to
   L2), so that the next chunk's first pass, which takes every line of it from the level below L1, finds them
   in L1 like the later passes: on that AVX2 CPU the model's products, interleaved against the source before, 8-16
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
   moments), level with float32, and the SSE2 tile's 8-24 rows 1.1-1.2x (a scratch A/B of the two
   sources' products). With 2-3 passes (AVX2 4-8 rows, AVX-512 16-24 rows) the store and reload cost what they saved. */
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
  LP_INTERNAL int gemm_##SUF(const float *x, const WT *p, const float *b, float *y, long M, long N, long K,  \
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

