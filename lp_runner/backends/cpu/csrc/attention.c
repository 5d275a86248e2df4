/* lp_runner's native attention: a few packed rows over a K/V buffer (backends/cpu/attention.py calls it; the
   layers in layers.c too). */
#include "lp_native.h"

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

/* Sixteen sources' lane sums at once (lane l of part u of out: hsum_parts of source u * VL + l), by a
   transpose-and-add tree instead of 16 horizontal sums: each source's lanes are added in hsum16's order whatever
   its neighbours hold, so the bits are hsum_parts' on every instruction set. AVX-512: 15 shuffle-add steps for
   the 16. AVX2: per 8 sources, a vertical add of the two halves, then pairs of sources (k, k + 4) trade 128-bit
   halves, quads trade pairs and the last step adds neighbours, landing source k in lane k; 4-float vectors alike
   with one step fewer. (16 hsum_parts, each extracting and adding down to a scalar, then the scale and the mask
   applied key by key: the AVX2 build's 8- and 16-row attention 1.11x slower on one thread of an AVX2 CPU.) */
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
   thread of an AVX2 CPU. 4 KB and 16 KB blocks measured the same as 8.) */
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

/* lp_native_attention_f32 over segments (see there): each task is up to RB packed rows of one segment and one
   head, so a task's rows share their keys, and a row's arithmetic is the one a call of its segment alone gives
   (its keys at the same offsets from the segment's base, the same mask row): bit for bit. With one segment the
   tasks are the plain call's. G = M / Q query heads per K/V head (any M with one segment). */
LP_INTERNAL int attention_segments(const float *q, const float *k, const float *v, const float *mask, float *out,
                                   long H, long M, long Q, long D, long ks, long vs, float scale, int threads,
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

/* Attention of a few packed rows over a K/V buffer (backends/cpu/attention.py, with the native product).

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
