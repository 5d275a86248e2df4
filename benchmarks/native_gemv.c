/* A plain fp32 GEMV/GEMM for few rows, for benchmarks/linear_kernels.py --native: how close to the memory-bound
   limit can a forward's products get on this CPU, against oneDNN's prepacked ones? Not used by lp_runner.

   y[m*N + n] = sum_k x[m*K + k] * w[n*K + k] (+ b[n]) for m < M <= 8, n < N; w row-major [N, K] (nn.Linear's
   weight as stored). Each weight row is streamed once; its 16-float slices meet every input row while in
   registers (GCC vector extensions: AVX-512 with -march=native where the CPU has it). Rows split over OpenMP
   threads; linked against the libgomp torch already loaded (same soname), so both share one thread pool. */
#include <stddef.h>

typedef float v16 __attribute__((vector_size(64), aligned(4)));

static inline float hsum(v16 a) {
  float s = 0.f;
  for (int i = 0; i < 16; i++) s += a[i];
  return s;
}

#define ROW_KERNEL(MM)                                                                                   \
  static inline void row_##MM(const float *x, const float *wr, const float *b, float *y, int n, int N, \
                              int K) {                                                                 \
    v16 a[MM][2];                                                                                      \
    for (int m = 0; m < MM; m++) a[m][0] = a[m][1] = (v16){0};                                           \
    int k = 0;                                                                                         \
    for (; k + 32 <= K; k += 32) {                                                                     \
      v16 w0 = *(const v16 *)(wr + k), w1 = *(const v16 *)(wr + k + 16);                               \
      for (int m = 0; m < MM; m++) {                                                                   \
        a[m][0] += w0 * *(const v16 *)(x + (size_t)m * K + k);                                          \
        a[m][1] += w1 * *(const v16 *)(x + (size_t)m * K + k + 16);                                     \
      }                                                                                                \
    }                                                                                                  \
    for (int m = 0; m < MM; m++) {                                                                     \
      float s = hsum(a[m][0] + a[m][1]);                                                               \
      for (int j = k; j < K; j++) s += wr[j] * x[(size_t)m * K + j];                                   \
      y[(size_t)m * N + n] = b ? s + b[n] : s;                                                         \
    }                                                                                                  \
  }
ROW_KERNEL(1) ROW_KERNEL(2) ROW_KERNEL(3) ROW_KERNEL(4) ROW_KERNEL(5) ROW_KERNEL(6) ROW_KERNEL(7) ROW_KERNEL(8)

int lp_gemv_f32(const float *x, const float *w, const float *b, float *y, int M, int N, int K, int threads) {
  if (M < 1 || M > 8) return -1;
#pragma omp parallel for num_threads(threads) schedule(static)
  for (int n = 0; n < N; n++) {
    const float *wr = w + (size_t)n * K;
    switch (M) {
      case 1: row_1(x, wr, b, y, n, N, K); break;
      case 2: row_2(x, wr, b, y, n, N, K); break;
      case 3: row_3(x, wr, b, y, n, N, K); break;
      case 4: row_4(x, wr, b, y, n, N, K); break;
      case 5: row_5(x, wr, b, y, n, N, K); break;
      case 6: row_6(x, wr, b, y, n, N, K); break;
      case 7: row_7(x, wr, b, y, n, N, K); break;
      default: row_8(x, wr, b, y, n, N, K); break;
    }
  }
  return 0;
}
