/* A MoE layer's experts on the GEMM of gemm.c: experts_ffn runs every expert of a layer on rows already sorted by
   expert, moe_ffn takes routed tokens as the router left them (ids and gates) and does the sorting, the gather and
   the gated sum back too. float32 and bfloat16. */
#include "common.h"

/* starts[e] = the first of expert e's rows, counts[e] of them, in rows sorted by expert; starts[E] = all rows. */
static void expert_starts(const long *counts, long E, long *starts) {
    starts[0] = 0;
    for (long e = 0; e < E; e++) starts[e + 1] = starts[e] + counts[e];
}

/* One MoE layer's experts in one call, so that the dozens of small torch operations around each expert's two
   GEMMs (slices, the activation, their launches on the thread pool) become one barrier. x [N, D]: the routed
   rows sorted by expert, counts[e] of them for expert e; w1 + e * s1 and w3 + e * s3 expert e's [F, D] (w3 NULL
   for gelu), w2 + e * s2 its [D, F]: the stacked weights where the checkpoint put them (no [w1; w3] copy to
   make at load); h [N, F or 2F] scratch (gate columns, then up); y [N, D] out.

   Each thread activates the columns of h it computed itself (the rows of w1 and w3 that thread_rows gives it), so
   that only the second GEMMs, which read all of h, wait for the other threads: every expert's first GEMMs, one
   barrier, every expert's second. A decode step's two experts were four barriers, each a point where the faster
   thread stood idle and memory with it. */
static void activate(float *g, long F, long c0, long c1, int swiglu) { /* columns c0..c1-1 of a row of h, in place */
    for (long c = c0; c < c1; c++)
        g[c] = swiglu ? g[c] / (1.0f + expf(-g[c])) * g[c + F]
                      : 0.5f * g[c] * (1.0f + erff(g[c] * 0.70710678118654752f));
}

void experts_ffn(const float *x, const long *counts, const float *w1, const float *w3, const float *w2, long s1,
                 long s3, long s2, float *h, float *y, long E, long D, long F, int threads) {
    long starts[E + 1];
    expert_starts(counts, E, starts);
    const int swiglu = w3 != 0;
    const long H = swiglu ? 2 * F : F;
#pragma omp parallel num_threads(threads)
    {
        const int t = omp_get_thread_num(), T = omp_get_num_threads();
        long c0, c1;
        const int mine = thread_rows(F, t, T, &c0, &c1);
        for (long e = 0; e < E; e++) {
            const long r0 = starts[e], n = starts[e + 1] - r0;
            if (n == 0 || !mine) continue;
            float *he = h + r0 * H;
            share(x + r0 * D, D, w1 + e * s1, D, he, H, n, F, D, t, T);
            if (swiglu) share(x + r0 * D, D, w3 + e * s3, D, he + F, H, n, F, D, t, T);
            for (long j = 0; j < n; j++) activate(he + j * H, F, c0, c1, swiglu);
        }
#pragma omp barrier
        for (long e = 0; e < E; e++) {
            const long r0 = starts[e], n = starts[e + 1] - r0;
            if (n) share(h + r0 * H, H, w2 + e * s2, F, y + r0 * D, D, n, D, F, t, T);
        }
    }
}

/* experts_ffn on bf16 weights and rows: the first GEMMs land in float32 (h), the activation is computed there
   and rounded to bf16 once (hb [N, F]), the second GEMM's input. */
void experts_ffn_bf16(const bf16 *x, const long *counts, const bf16 *w1, const bf16 *w3, const bf16 *w2, long s1,
                      long s3, long s2, float *h, bf16 *hb, bf16 *y, long E, long D, long F, int threads) {
    long starts[E + 1];
    expert_starts(counts, E, starts);
    const int swiglu = w3 != 0;
    const long H = swiglu ? 2 * F : F;
#pragma omp parallel num_threads(threads)
    {
        const int t = omp_get_thread_num(), T = omp_get_num_threads();
        long c0, c1;
        const int mine = thread_rows(F, t, T, &c0, &c1);
        for (long e = 0; e < E; e++) {
            const long r0 = starts[e], n = starts[e + 1] - r0;
            if (n == 0 || !mine) continue;
            float *he = h + r0 * H;
            share_b(x + r0 * D, D, w1 + e * s1, D, he, 0, H, n, F, D, t, T);
            if (swiglu) share_b(x + r0 * D, D, w3 + e * s3, D, he + F, 0, H, n, F, D, t, T);
            for (long j = 0; j < n; j++) {
                activate(he + j * H, F, c0, c1, swiglu);
                for (long c = c0; c < c1; c++) hb[(r0 + j) * F + c] = float_bf16(he[j * H + c]);
            }
        }
#pragma omp barrier
        for (long e = 0; e < E; e++) {
            const long r0 = starts[e], n = starts[e + 1] - r0;
            if (n) share_b(hb + r0 * F, F, w2 + e * s2, F, 0, y + r0 * D, D, n, D, F, t, T);
        }
    }
}

/* A MoE layer's routed experts whole: the T tokens' K assignments each (ids, gates [T, K]) sorted by expert, the
   rows gathered, the experts run (experts_ffn), and each token's outputs summed back with their gates. In torch
   that was a dozen operations around the one call (argsort, bincount, a gather, a scatter-add, ...) around
   each decode step's layer. The sums are torch's (the tests hold the torch operations it replaced): the assignments
   in order of expert, stably, each product rounded to the output's dtype and added to the token's row in that
   order (in bf16, summed in float32 and rounded once, as torch's index_add_ does).
   Returns -1, having read and written nothing, where an id lies outside [0, E). */
static int sort_by_expert(const long *ids, long N, long E, long *counts, long *order) {
    long starts[E + 1];
    for (long e = 0; e < E; e++) counts[e] = 0;
    for (long n = 0; n < N; n++) {
        if (ids[n] < 0 || ids[n] >= E) return -1;
        counts[ids[n]]++;
    }
    expert_starts(counts, E, starts);
    for (long n = 0; n < N; n++) order[starts[ids[n]]++] = n; /* stable: argsort(stable=True) */
    return 0;
}

/* The rows of x [n_tok, D] (elements of `size` bytes) in that order into xs [N, D], row j being assignment order[j]'s
   token. -1 (nothing gathered) for an id outside [0, E). */
static int gather_by_expert(const void *x, const long *ids, long N, long K, long E, long D, size_t size, long *counts,
                            long *order, void *xs) {
    if (sort_by_expert(ids, N, E, counts, order)) return -1;
    for (long j = 0; j < N; j++) memcpy((char *)xs + j * D * size, (const char *)x + order[j] / K * D * size, D * size);
    return 0;
}

int moe_ffn(const float *x, const long *ids, const float *gates, long n_tok, long K, const float *w1, const float *w3,
            const float *w2, long s1, long s3, long s2, float *out, long E, long D, long F, int threads) {
    const long N = n_tok * K;
    long counts[E], *order = malloc((N + 1) * sizeof(long));
    float *xs = malloc((N * D + 1) * sizeof(float)), *ys = malloc((N * D + 1) * sizeof(float)),
          *h = malloc((N * (w3 ? 2 : 1) * F + 1) * sizeof(float));
    int status = !(order && xs && ys && h) ? -2 : gather_by_expert(x, ids, N, K, E, D, sizeof(float), counts, order, xs);
    if (status == 0) {
        experts_ffn(xs, counts, w1, w3, w2, s1, s3, s2, h, ys, E, D, F, threads);
        memset(out, 0, n_tok * D * sizeof(float));
        for (long j = 0; j < N; j++) {
            float *o = out + order[j] / K * D;
            const float g = gates[order[j]];
            for (long d = 0; d < D; d++) o[d] = o[d] + ys[j * D + d] * g; /* two roundings: built without contraction */
        }
    }
    free(order), free(xs), free(ys), free(h);
    return status;
}

int moe_ffn_bf16(const bf16 *x, const long *ids, const bf16 *gates, long n_tok, long K, const bf16 *w1, const bf16 *w3,
                 const bf16 *w2, long s1, long s3, long s2, bf16 *out, long E, long D, long F, int threads) {
    const long N = n_tok * K;
    long counts[E], *order = malloc((N + 1) * sizeof(long));
    bf16 *xs = malloc((N * D + 1) * sizeof(bf16)), *ys = malloc((N * D + 1) * sizeof(bf16)),
         *hb = malloc((N * F + 1) * sizeof(bf16));
    float *h = malloc((N * (w3 ? 2 : 1) * F + 1) * sizeof(float)), *sum = calloc(n_tok * D + 1, sizeof(float));
    int status = !(order && xs && ys && hb && h && sum) ? -2
                 : gather_by_expert(x, ids, N, K, E, D, sizeof(bf16), counts, order, xs);
    if (status == 0) {
        experts_ffn_bf16(xs, counts, w1, w3, w2, s1, s3, s2, h, hb, ys, E, D, F, threads);
        for (long j = 0; j < N; j++) { /* each product rounded to bf16, the sum in float32 (torch's bf16 index_add_) */
            float *o = sum + order[j] / K * D;
            const float g = bf16_float(gates[order[j]]);
            for (long d = 0; d < D; d++) o[d] += round_bf16(bf16_float(ys[j * D + d]) * g);
        }
        for (long i = 0; i < n_tok * D; i++) out[i] = float_bf16(sum[i]);
    }
    free(order), free(xs), free(ys), free(hb), free(h), free(sum);
    return status;
}
/* ---- quantized experts (quant.c's GEMM) ---------------------------------------------------------------------- */

/* Expert e's weight and scales in stacked quantized tensors: the weight's bytes at w + e * s, its scales (float32
   for int8, float16 for int4) at scale + e * ss elements. */
static const void *q_weight(const void *w, long e, long s) { return w ? (const char *)w + e * s : 0; }
static const void *q_scale(const void *scale, int fmt, long e, long ss) {
    if (!scale) return 0;
    return fmt == QUANT_INT8 ? (const void *)((const float *)scale + e * ss)
                             : (const void *)((const unsigned short *)scale + e * ss);
}

/* experts_ffn on quantized weights: the routed rows xs (sorted by expert, float32, or bf16 where xb) quantized
   once, every expert's first GEMMs, each thread's columns activated (rounded to bf16 in hb first for a bf16 call,
   as experts_ffn_bf16 does), the activations quantized, every expert's second GEMM into y (float32, or bf16 yb).
   Two more barriers than experts_ffn: each quantization needs whole rows. */
static void experts_ffn_q(const float *xf, const bf16 *xb, const long *counts, int fmt, long group, const void *w1,
                          const void *w3, const void *w2, const void *c1, const void *c3, const void *c2, long s1,
                          long s3, long s2, long t1, long t3, long t2, float *h, bf16 *hb, float *yf, bf16 *yb,
                          struct qx *px, struct qx *ph, long *starts, long E, long D, long F, int threads) {
    expert_starts(counts, E, starts); /* starts: E + 1 of them, the caller's */
    const long N = starts[E], H = w3 ? 2 * F : F;
#pragma omp parallel num_threads(threads)
    {
        const int t = omp_get_thread_num(), T = omp_get_num_threads();
        long c0, c1_;
        const int mine = thread_rows(F, t, T, &c0, &c1_);
        if (xb) quantize_rows_b(xb, D, N, px, t, T); else quantize_rows(xf, D, N, px, t, T);
#pragma omp barrier
        for (long e = 0; e < E; e++) {
            const long r0 = starts[e], n = starts[e + 1] - r0;
            if (n == 0 || !mine) continue;
            const struct qx xe = qx_rows(px, r0);
            float *he = h + r0 * H;
            share_q(&xe, n, q_weight(w1, e, s1), q_scale(c1, fmt, e, t1), fmt, group, he, 0, H, F, t, T);
            if (w3) share_q(&xe, n, q_weight(w3, e, s3), q_scale(c3, fmt, e, t3), fmt, group, he + F, 0, H, F, t, T);
            for (long j = 0; j < n; j++) {
                activate(he + j * H, F, c0, c1_, w3 != 0);
                if (hb)
                    for (long c = c0; c < c1_; c++) hb[(r0 + j) * F + c] = float_bf16(he[j * H + c]);
            }
        }
#pragma omp barrier
        if (hb) quantize_rows_b(hb, F, N, ph, t, T); else quantize_rows(h, H, N, ph, t, T);
#pragma omp barrier
        for (long e = 0; e < E; e++) {
            const long r0 = starts[e], n = starts[e + 1] - r0;
            if (!n) continue;
            const struct qx he = qx_rows(ph, r0);
            share_q(&he, n, q_weight(w2, e, s2), q_scale(c2, fmt, e, t2), fmt, group, yf ? yf + r0 * D : 0,
                    yb ? yb + r0 * D : 0, D, D, t, T);
        }
    }
}

/* moe_ffn's routed tokens on quantized experts: the same sorting, gather and gated sums (float32 as moe_ffn,
   bf16 as moe_ffn_bf16), the experts by experts_ffn_q. -4 for a format or group the widths do not take. */
#define MOE_FFN_Q(NAME, T, BF)                                                                         \
    int NAME(const T *x, const long *ids, const T *gates, long n_tok, long K, int fmt, long group, const void *w1, \
             const void *w3, const void *w2, const void *c1, const void *c3, const void *c2, long s1, long s3,    \
             long s2, long t1, long t3, long t2, T *out, long E, long D, long F, int threads) {         \
        if (!quant_format_ok(fmt, group, D) || !quant_format_ok(fmt, group, F)) return -4;             \
        const long N = n_tok * K;                                                                      \
        long *order = malloc((N + 2 * E + 2) * sizeof(long)), *counts = order + N + 1;                \
        T *xs = malloc((N * D + 1) * sizeof(T)), *ys = malloc((N * D + 1) * sizeof(T));                \
        bf16 *hb = BF ? malloc((N * F + 1) * sizeof(bf16)) : 0;                                        \
        float *h = malloc((N * (w3 ? 2 : 1) * F + 1) * sizeof(float)), *sum = calloc(n_tok * D + 1, sizeof(float)); \
        void *mx = malloc(qx_bytes(N, D)), *mh = malloc(qx_bytes(N, F));                               \
        int status = !(order && xs && ys && (hb || !BF) && h && sum && mx && mh) ? -2                  \
                     : gather_by_expert(x, ids, N, K, E, D, sizeof(T), counts, order, xs);             \
        if (status == 0) {                                                                             \
            struct qx px = qx_at(mx, N, D), ph = qx_at(mh, N, F);                                      \
            experts_ffn_q(BF ? 0 : (const float *)xs, BF ? (const bf16 *)xs : 0, counts, fmt, group, w1, w3, w2, \
                          c1, c3, c2, s1, s3, s2, t1, t3, t2, h, hb, BF ? 0 : (float *)ys, BF ? (bf16 *)ys : 0, \
                          &px, &ph, counts + E, E, D, F, threads);                                     \
            combine_##T(ys, gates, order, N, K, n_tok, D, sum, out);                                   \
        }                                                                                              \
        free(order), free(xs), free(ys), free(hb), free(h), free(sum), free(mx), free(mh);             \
        return status;                                                                                 \
    }

/* each token's outputs summed back with their gates, as moe_ffn (float32) and moe_ffn_bf16 do */
static void combine_float(const float *ys, const float *gates, const long *order, long N, long K, long n_tok, long D,
                          float *sum, float *out) {
    (void)sum;
    memset(out, 0, n_tok * D * sizeof(float));
    for (long j = 0; j < N; j++) {
        float *o = out + order[j] / K * D;
        const float g = gates[order[j]];
        for (long d = 0; d < D; d++) o[d] = o[d] + ys[j * D + d] * g;
    }
}
static void combine_bf16(const bf16 *ys, const bf16 *gates, const long *order, long N, long K, long n_tok, long D,
                         float *sum, bf16 *out) {
    for (long j = 0; j < N; j++) {
        float *o = sum + order[j] / K * D;
        const float g = bf16_float(gates[order[j]]);
        for (long d = 0; d < D; d++) o[d] += round_bf16(bf16_float(ys[j * D + d]) * g);
    }
    for (long i = 0; i < n_tok * D; i++) out[i] = float_bf16(sum[i]);
}

MOE_FFN_Q(moe_ffn_q, float, 0)
MOE_FFN_Q(moe_ffn_q_bf16, bf16, 1)
