/* lp_runner's native fp32 product for CPU forwards (lp_runner/native.py builds and loads it; model.prepack).

   y[m*N + n] = sum_k x[m*K + k] * w[n][k] (+ b[n]) for m < M, n < N, with the weight packed once
   (native.pack) into blocks of NB output columns: p[block][k][c] = w[block*NB + c][k], the last block zero-padded.
   One block is one contiguous stream of K*NB floats; for up to 8 input rows at a time, each k loads the block's
   two vectors once and multiplies them into 2 accumulators per row (x[m][k] broadcast): no horizontal sums,
   no re-reads of the weight from memory, so a forward of 1-8 rows costs about the weights' bytes over the
   memory bandwidth. Blocks split over OpenMP threads (torch's libgomp: the same soname, already loaded).

   Every output is the sum over k in increasing order of one row and one column, whatever M, the row's place in
   the call or the block the column falls in: a row's result does not depend on the rows beside it, and the
   columns of stacked sibling weights are those of each weight alone (bit for bit). */
#include <stddef.h>
#include <stdlib.h>
#include <string.h>

#define NB 32
typedef float v16 __attribute__((vector_size(64), aligned(4)));

#define MICRO(MM)                                                                                        \
  static inline void micro_##MM(const float *x, const float *pb, float *out, int N, int K, int ncols) { \
    v16 a[MM][2];                                                                                      \
    for (int m = 0; m < MM; m++) a[m][0] = a[m][1] = (v16){0};                                           \
    for (int k = 0; k < K; k++) {                                                                      \
      v16 w0 = *(const v16 *)(pb + (size_t)k * NB), w1 = *(const v16 *)(pb + (size_t)k * NB + 16);      \
      for (int m = 0; m < MM; m++) {                                                                   \
        float xs = x[(size_t)m * K + k];                                                               \
        a[m][0] += w0 * xs;                                                                            \
        a[m][1] += w1 * xs;                                                                            \
      }                                                                                                \
    }                                                                                                  \
    for (int m = 0; m < MM; m++) {                                                                     \
      float tmp[NB];                                                                                   \
      memcpy(tmp, &a[m][0], sizeof(v16));                                                              \
      memcpy(tmp + 16, &a[m][1], sizeof(v16));                                                         \
      memcpy(out + (size_t)m * N, tmp, sizeof(float) * (size_t)ncols);                                 \
    }                                                                                                  \
  }
MICRO(1) MICRO(2) MICRO(3) MICRO(4) MICRO(5) MICRO(6) MICRO(7) MICRO(8)

static inline void micro(int mm, const float *x, const float *pb, float *out, int N, int K, int ncols) {
  switch (mm) {
    case 1: micro_1(x, pb, out, N, K, ncols); break;
    case 2: micro_2(x, pb, out, N, K, ncols); break;
    case 3: micro_3(x, pb, out, N, K, ncols); break;
    case 4: micro_4(x, pb, out, N, K, ncols); break;
    case 5: micro_5(x, pb, out, N, K, ncols); break;
    case 6: micro_6(x, pb, out, N, K, ncols); break;
    case 7: micro_7(x, pb, out, N, K, ncols); break;
    default: micro_8(x, pb, out, N, K, ncols); break;
  }
}

/* x [M, K], p packed [ceil(N/NB), K, NB], b [N] or NULL, y [M, N]; all float32, contiguous. 0, or -1 on bad sizes. */
int lp_native_gemm_f32(const float *x, const float *p, const float *b, float *y, long M, long N, long K,
                       int threads) {
  if (M < 1 || N < 1 || K < 1 || threads < 1) return -1;
  long blocks = (N + NB - 1) / NB;
#pragma omp parallel for num_threads(threads) schedule(static)
  for (long blk = 0; blk < blocks; blk++) {
    long n = blk * NB;
    int ncols = N - n < NB ? (int)(N - n) : NB;
    const float *pb = p + (size_t)blk * K * NB;
    for (long m0 = 0; m0 < M; m0 += 8) {
      int mm = M - m0 < 8 ? (int)(M - m0) : 8;
      micro(mm, x + (size_t)m0 * K, pb, y + (size_t)m0 * N + n, (int)N, (int)K, ncols);
    }
    if (b)
      for (long m = 0; m < M; m++)
        for (int c = 0; c < ncols; c++) y[(size_t)m * N + n + c] += b[n + c];
  }
  return 0;
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

/* Attention of a few packed rows over a K/V buffer (lp_runner/attention.py, with the native product).

   q [H, M, D]: the M = groups x Q packed query rows of each K/V head h (row r reads the mask of round row r % Q);
   k, v [H, C, D]: the cache's first C slots, head h at k + h * ks (v + h * vs), each slot D contiguous floats;
   mask [Q, C] additive (0 visible; a key at or below -1e30 hidden);
   out [H, M, D]. Per (h, r): s_j = (q . k_j) * scale + mask_j over the visible keys only, softmax, sum_j p_j v_j.
   A hidden key's weight is exp(-huge) = 0 in fp32 in any softmax, so skipping it changes nothing. */
int lp_native_attention_f32(const float *q, const float *k, const float *v, const float *mask, float *out, long H,
                            long M, long Q, long C, long D, long ks, long vs, float scale, int threads) {
  if (H < 1 || M < 1 || Q < 1 || C < 1 || D < 1 || threads < 1) return -1;
  int failed = 0;
#pragma omp parallel num_threads(threads)
  {
    float *s = (float *)malloc(sizeof(float) * (size_t)C);
    int *idx = (int *)malloc(sizeof(int) * (size_t)C);
    if (!s || !idx) {
#pragma omp atomic write
      failed = 1;
    }
#pragma omp for schedule(static)
    for (long t = 0; t < H * M; t++) {
      if (!s || !idx) continue;
      long h = t / M, r = t % M;
      const float *qr = q + (size_t)t * D, *mr = mask + (size_t)(r % Q) * C;
      const float *kh = k + (size_t)h * ks, *vh = v + (size_t)h * vs;
      float *o = out + (size_t)t * D;
      int n = 0;
      float best = -3.4e38f;
      for (long j = 0; j < C; j++) {
        if (mr[j] <= -1e30f) continue;
        const float *kj = kh + (size_t)j * D;
        float dot = 0.f;
        if (D % 16 == 0) {
          v16 acc = {0};
          for (long d = 0; d < D; d += 16) acc += *(const v16 *)(qr + d) * *(const v16 *)(kj + d);
          dot = hsum16(acc);
        } else {
          for (long d = 0; d < D; d++) dot += qr[d] * kj[d];
        }
        float sj = dot * scale + mr[j];
        s[n] = sj;
        idx[n++] = (int)j;
        if (sj > best) best = sj;
      }
      float total = 0.f;
      for (int i = 0; i < n; i++) total += (s[i] = __builtin_expf(s[i] - best));
      for (long d = 0; d < D; d++) o[d] = 0.f;
      for (int i = 0; i < n; i++) {
        float p = s[i] / total;
        const float *vj = vh + (size_t)idx[i] * D;
        for (long d = 0; d < D; d++) o[d] += p * vj[d];
      }
    }
    free(s);
    free(idx);
  }
  return failed ? -2 : 0;
}
