/* lp_runner's native Llama-family decoder layers (backends/cpu/native_layers.py says when they run): the products
   of gemm.c and the attention of attention.c composed with the layer's row-wise steps, in one call. */
#include "lp_native.h"

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
   expf per element took 1.4-3.7 ms of a 27-31 ms 8-row forward of the embedded model in a timing harness (on an
   x86 CPU; it varied with the activations); this takes about 0.2 ms. Lane by lane, a partial last vector
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
   embedded model 35-39 us between two layers' calls, 1.0-1.1 ms of a 15-24 ms forward on a 2-core
   CPU: the interpreter ran from caches the weights' stream had just emptied. The table of pointers is
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

/* lp_native_llama_layers over a batched round (lp_runner/backends/cpu/native.py, SegmentTable): the rows of nseg generations, each
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
