/* tests/test_native_isa.py: deterministic inputs (an LCG, the same on every target) through the native kernels
   (products of 1-17 rows, attention for head sizes 16-128 and a scalar one, one decoder layer), every output
   printed as a hex float, so builds for different instruction sets or machines can be compared bit for bit. */
#include <stdio.h>
#include <stdint.h>
#include <stdlib.h>
#include "lp_native.h" /* -I lp_runner/backends/cpu/csrc, built with its *.c files */
static uint32_t st = 12345;
static float rnd(void) { st = st * 1664525u + 1013904223u; return ((st >> 8) / 16777216.0f) * 2.f - 1.f; }
static void fill(float *x, long n) { for (long i = 0; i < n; i++) x[i] = rnd(); }
static void pack(const float *w, float *p, long N, long K) { /* p[blk][k][c] = w[blk*32+c][k] */
  long blocks = (N + NB - 1) / NB;
  for (long b = 0; b < blocks; b++) for (long k = 0; k < K; k++) for (long c = 0; c < NB; c++) {
    long n = b * NB + c; p[(b * K + k) * NB + c] = n < N ? w[n * K + k] : 0.f; }
}
int main(void) {
  long N = 70, K = 67; float w[70 * 67], b[70], p[3 * 67 * 32], x[17 * 67], y[17 * 70];
  fill(w, N * K); fill(b, N); pack(w, p, N, K);
  for (long M = 1; M <= 17; M++) {
    fill(x, M * K);
    if (lp_native_gemm_f32(x, p, b, y, M, N, K, 2)) return 1;
    for (long i = 0; i < M * N; i++) printf("%a\n", y[i]);
  }
  long dims[] = {16, 32, 48, 64, 128, 40};
  for (int t = 0; t < 6; t++) {
    long D = dims[t], H = 2, Q = 3, G = 2, C = 37, M = Q * G;
    float *q = malloc(sizeof(float) * H * M * D), *k = malloc(sizeof(float) * H * C * D), *v = malloc(sizeof(float) * H * C * D);
    float *mask = malloc(sizeof(float) * Q * C), *out = malloc(sizeof(float) * H * M * D);
    fill(q, H * M * D); fill(k, H * C * D); fill(v, H * C * D);
    for (long i = 0; i < Q * C; i++) mask[i] = (rnd() < -0.4f && i % C) ? -3.4028234663852886e38f : 0.f;
    if (lp_native_attention_f32(q, k, v, mask, out, H, M, Q, C, D, C * D, C * D, 0.125f, 2)) return 2;
    for (long i = 0; i < H * M * D; i++) printf("%a\n", out[i]);
    free(q); free(k); free(v); free(mask); free(out);
  }
  { /* one decoder layer: E 64, H 4, Hkv 2, D 16, I 96, R 5 rows, C 20 slots */
    long E = 64, H = 4, Hkv = 2, D = 16, I = 96, R = 5, C = 20, nqkv = H * D + 2 * Hkv * D;
    float *h = malloc(4 * R * E), *ln1 = malloc(4 * E), *ln2 = malloc(4 * E);
    float *wqkv = malloc(4 * nqkv * E), *wo = malloc(4 * E * H * D), *wgu = malloc(4 * 2 * I * E), *wd = malloc(4 * E * I);
    float *pqkv = calloc(((nqkv + 31) / 32) * 32 * E, 4), *po = calloc(((E + 31) / 32) * 32 * H * D, 4);
    float *pgu = calloc(((2 * I + 31) / 32) * 32 * E, 4), *pd = calloc(((E + 31) / 32) * 32 * I, 4);
    float *cs = malloc(4 * R * D), *sn = malloc(4 * R * D), *kb = malloc(4 * Hkv * C * D), *vb = malloc(4 * Hkv * C * D);
    float *mask = malloc(4 * R * C); long slots[5] = {15, 16, 17, 18, 19};
    fill(h, R * E); fill(ln1, E); fill(ln2, E); fill(wqkv, nqkv * E); fill(wo, E * H * D); fill(wgu, 2 * I * E);
    fill(wd, E * I); fill(cs, R * D); fill(sn, R * D); fill(kb, Hkv * C * D); fill(vb, Hkv * C * D);
    pack(wqkv, pqkv, nqkv, E); pack(wo, po, E, H * D); pack(wgu, pgu, 2 * I, E); pack(wd, pd, E, I);
    for (long r = 0; r < R; r++) for (long c = 0; c < C; c++) mask[r * C + c] = c <= 15 + r ? 0.f : -3.4028234663852886e38f;
    int st2 = lp_native_llama_layer(h, ln1, ln2, 1e-5f, pqkv, NULL, po, NULL, pgu, NULL, pd, NULL, cs, sn, kb, vb,
                                    C * D, C * D, slots, mask, C, R, E, H, Hkv, D, I, 0.25f, 2);
    if (st2) return 3;
    for (long i = 0; i < R * E; i++) printf("%a\n", h[i]);
    for (long i = 0; i < Hkv * C * D; i++) printf("%a\n", kb[i]);
  }
  return 0;
}
