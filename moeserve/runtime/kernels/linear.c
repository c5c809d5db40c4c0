/* y = x w^T, float32 (bfloat16 below), for w [O, I] stored row by row (nn.Linear's layout, no repacking);
   and below it, a MoE layer's experts in one call, RMSNorm, and a decode step's attention over the KV cache.

   oneDNN and MKL stream a weight at memory speed for one row of x, but at two to eight rows (the rows
   one expert receives in a decode step of several sequences) they fall to half of it: their small-M
   GEMMs are not written for this. Here each thread walks its share of w's rows once, R at a time, and
   dots each with all n rows of x (which stay in cache), so w is read once whatever n is, at close to
   the speed of one row. Past 8 rows (prefill) the rows of x go 6 at a time over blocks of 24 rows of
   w that stay in the L2 cache: w is still read from memory once, and the next block is fetched while
   the rows of x go over this one (prefetch_shift).

   Every output y[j, o] is the same sum in the same order (8-lane partial sums over i, the lanes added
   left to right, then the tail) whatever n, R or the thread count is: a row's result does not depend
   on which other rows share the call, so batching never changes a sequence's logits. */
#include <math.h>
#include <omp.h>
#include <stdlib.h>
#include <string.h>

typedef float v8 __attribute__((vector_size(32), aligned(4))); /* unaligned loads: mmap'd weights */

/* acc + w * x, rounded the same way at every call site: built with -ffp-contract=off, so that the
   compiler never fuses a multiply-add in one loop and not in another. */
#if defined(__FMA__) && defined(__AVX__)
#include <immintrin.h>
static inline v8 fma8(v8 w, v8 x, v8 acc) { return (v8)_mm256_fmadd_ps((__m256)w, (__m256)x, (__m256)acc); }
#else
static inline v8 fma8(v8 w, v8 x, v8 acc) { return w * x + acc; }
#endif

static inline float finish(v8 acc, const float *w, const float *x, long i0, long I) {
    float s = 0.0f;
    for (int k = 0; k < 8; k++) s += acc[k];
    for (long i = i0; i < I; i++) s += w[i] * x[i];
    return s;
}

/* Rows [o0, o1) of w against n = N rows of x, R rows of w at a time (N * R accumulators, kept near 12
   of the 16 vector registers), the rest of the range one row at a time. Prefetching keeps memory busy
   while the FMAs of several x rows run: +25-45% at 4 rows, +15% at 8 (AVX2 EPYC). It walks the next R
   rows as they lie in memory, one line after the other (R/2 lines a step, a step reading R * 32 bytes),
   rather than at the R offsets the loads read: R streams a page apart (a row of 1024 floats is 4 KB)
   kept the hardware's prefetchers from streaming, and a weight read at 22-27 GB/s where a plain read of
   memory ran at 31-35 (one row of x, AVX512 EPYC); walking them in order, 28-33, and the same speed as
   before on a weight already in cache. Rows not contiguous (ldw > I): the walk covers part of the gaps
   too, harmless (a prefetch never faults). pf, where not NULL, moves the walk elsewhere, at 1 / 2^pfs of
   the pace: the next block of a prefill (prefetch_shift). */
#define ROWS(N, R)                                                                                     \
    static void rows_##N(const float *x, long ldx, const float *w, long ldw, float *y, long ldy,        \
                         long o0, long o1, long I, const float *pf, int pfs) {                         \
        const long iv = I / 8 * 8;                                                                     \
        long o = o0;                                                                                   \
        for (; o + R <= o1; o += R) {                                                                  \
            const float *p = pf ? pf + (((o - o0) * ldw) >> pfs) : w + (o + R) * ldw;                   \
            v8 acc[R][N];                                                                              \
            for (int r = 0; r < R; r++)                                                                \
                for (int j = 0; j < N; j++) acc[r][j] = (v8){0};                                       \
            for (long i = 0; i < iv; i += 8) {                                                         \
                v8 wv[R];                                                                              \
                for (int r = 0; r < R; r++) {                                                          \
                    wv[r] = *(const v8 *)(w + (o + r) * ldw + i);                                      \
                    if (r % 2 == 0) __builtin_prefetch(p + ((i * R + r * 8) >> pfs)); /* see above */ \
                }                                                                                      \
                for (int j = 0; j < N; j++) {                                                          \
                    v8 xv = *(const v8 *)(x + j * ldx + i);                                            \
                    for (int r = 0; r < R; r++) acc[r][j] = fma8(wv[r], xv, acc[r][j]);                               \
                }                                                                                      \
            }                                                                                          \
            for (int r = 0; r < R; r++)                                                                \
                for (int j = 0; j < N; j++)                                                            \
                    y[j * ldy + o + r] = finish(acc[r][j], w + (o + r) * ldw, x + j * ldx, iv, I);     \
        }                                                                                              \
        for (; o < o1; o++) {                                                                          \
            v8 acc[N];                                                                                 \
            for (int j = 0; j < N; j++) acc[j] = (v8){0};                                              \
            for (long i = 0; i < iv; i += 8) {                                                         \
                v8 wv = *(const v8 *)(w + o * ldw + i);                                                \
                for (int j = 0; j < N; j++) acc[j] = fma8(wv, *(const v8 *)(x + j * ldx + i), acc[j]);            \
            }                                                                                          \
            for (int j = 0; j < N; j++) y[j * ldy + o] = finish(acc[j], w + o * ldw, x + j * ldx, iv, I); \
        }                                                                                              \
    }

/* One row of x (decode at batch 1) takes one weight row at a time: the weight then streams through memory in
   order, one sequential read per thread, which the hardware prefetches best. With 4 rows at a time (4 streams)
   the 644M Mixtral's decode step took 30.5 ms against 24.5 (fp32) and 16.9 against 15.9 (bf16), the same
   tokens; on weights already in cache 4 rows at a time is faster (1.5x for a hot [1024, 1024] fp32 weight),
   but at the model's level (the built-in model, whose weights nearly fit the L3 cache) one at a time was no
   slower. A row's sum is the same either way: each weight row has its own accumulators. */
#if defined(__AVX512F__) /* 32 vector registers: 24 accumulators for prefill's 6 rows (5% faster than 12) */
ROWS(1, 1) ROWS(2, 4) ROWS(3, 4) ROWS(4, 3) ROWS(5, 4) ROWS(6, 4) ROWS(7, 1) ROWS(8, 1)
#else
ROWS(1, 1) ROWS(2, 4) ROWS(3, 4) ROWS(4, 3) ROWS(5, 2) ROWS(6, 2) ROWS(7, 1) ROWS(8, 1)
#endif

typedef void (*rows_fn)(const float *, long, const float *, long, float *, long, long, long, long, const float *, int);
static const rows_fn ROWS_FOR[9] = {0, rows_1, rows_2, rows_3, rows_4, rows_5, rows_6, rows_7, rows_8};

enum { BLOCK = 24, CHUNK = 6 }; /* past 8 rows: blocks of 24 rows of w stay in L2 while x goes 6 rows at a time */

/* Past 8 rows, the first CHUNK rows of x over a block of w read the block from memory and the others read it
   from the cache: memory would stand idle while they compute. So each of the C chunks over a block also
   prefetches its share of the next block, c / C of the way into it, its walk going at 1 / 2^pfs of the pace
   of its own weight rows (2^pfs <= C: the shares overlap rather than leave gaps). On the 644M Mixtral's
   experts (9-128 rows each, weights 4x the caches) this took 4-19% off a layer (fp32 and bf16), and blocks of
   24 rather than 48 another 0-3%. Only the order of the reads changes, not a sum. */
static int prefetch_shift(long n) {
    const long C = (n + CHUNK - 1) / CHUNK;
    int pfs = 0;
    while ((2L << pfs) <= C) pfs++;
    return pfs;
}

/* Thread t of T's rows [*o0, *o1) of w's O: blocks of 12, a multiple of every R. Whether it has any. */
static int thread_rows(long O, int t, int T, long *o0, long *o1) {
    const long per = (O + T - 1) / T, part = (per + 11) / 12 * 12;
    *o0 = t * part;
    *o1 = *o0 + part < O ? *o0 + part : O;
    return *o0 < *o1;
}

/* Thread t of T's share of x [n, I] (row stride ldx) @ w [O, I]^T (row stride ldw) -> y [n, O] (row stride
   ldy). */
static void share(const float *x, long ldx, const float *w, long ldw, float *y, long ldy, long n, long O, long I,
                  int t, int T) {
    long o0, o1;
    if (!thread_rows(O, t, T, &o0, &o1) || n == 0) return;
    if (n <= 8) {
        ROWS_FOR[n](x, ldx, w, ldw, y, ldy, o0, o1, I, 0, 0);
        return;
    }
    const long C = (n + CHUNK - 1) / CHUNK;
    const int pfs = prefetch_shift(n);
    for (long b0 = o0; b0 < o1; b0 += BLOCK) {
        const long b1 = b0 + BLOCK < o1 ? b0 + BLOCK : o1, L = (b1 - b0) * ldw;
        for (long j0 = 0, c = 0; j0 < n; j0 += CHUNK, c++) {
            const long m = n - j0 < CHUNK ? n - j0 : CHUNK;
            ROWS_FOR[m](x + j0 * ldx, ldx, w, ldw, y + j0 * ldy, ldy, b0, b1, I, w + b1 * ldw + c * L / C, pfs);
        }
    }
}

void linear_nt(const float *x, long ldx, const float *w, long ldw, float *y, long ldy,
               long n, long O, long I, int threads) {
#pragma omp parallel num_threads(threads)
    share(x, ldx, w, ldw, y, ldy, n, O, I, omp_get_thread_num(), omp_get_num_threads());
}

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

/* bfloat16: the same GEMM on bf16 x and w, half the bytes to stream, the products summed in float32. Where the
   CPU has AVX512-BF16 (Zen 4, Sapphire Rapids), one instruction multiplies 32 pairs and adds them into 16
   float32 lanes; elsewhere each bf16 is widened to float32 (a shift) and summed by 8-lane FMAs, which is
   still half the bytes of float32 weights. Either way a row's result is the same sum in the same order
   whatever rows share the call. The output is rounded to bf16 (nearest even, as torch rounds), or kept in
   float32 where it feeds the activation (experts_ffn_bf16). */
typedef unsigned short bf16;

static inline float bf16_float(bf16 h) {
    union { unsigned u; float f; } c = {(unsigned)h << 16};
    return c.f;
}

static inline bf16 float_bf16(float f) {
    union { float f; unsigned u; } c = {f};
    if ((c.u & 0x7fffffffu) > 0x7f800000u) return (bf16)((c.u >> 16) | 0x40); /* NaN stays a (quiet) NaN */
    return (bf16)((c.u + 0x7fffu + ((c.u >> 16) & 1u)) >> 16);
}

#if defined(__AVX512BF16__) && defined(__AVX512F__)
typedef __m512 accb;
static inline accb zero32(void) { return _mm512_setzero_ps(); }
static inline accb dot32(const bf16 *w, const bf16 *x, accb acc) { /* 32 pairs -> 16 lanes */
    return _mm512_dpbf16_ps(acc, (__m512bh)_mm512_loadu_si512(w), (__m512bh)_mm512_loadu_si512(x));
}
static inline float lanes32(accb acc) { return _mm512_reduce_add_ps(acc); } /* a fixed tree */
int bf16_native(void) { return 1; }
#else
typedef v8 accb;
typedef unsigned short u16x8 __attribute__((vector_size(16), aligned(2)));
typedef unsigned int u32x8 __attribute__((vector_size(32)));
static inline v8 widen8(const bf16 *p) { return (v8)(__builtin_convertvector(*(const u16x8 *)p, u32x8) << 16); }
static inline accb zero32(void) { return (v8){0}; }
static inline accb dot32(const bf16 *w, const bf16 *x, accb acc) {
    for (int k = 0; k < 32; k += 8) acc = fma8(widen8(w + k), widen8(x + k), acc);
    return acc;
}
static inline float lanes32(accb acc) {
    float s = 0.0f;
    for (int k = 0; k < 8; k++) s += acc[k];
    return s;
}
int bf16_native(void) { return 0; }
#endif

static inline float finish_b(accb acc, const bf16 *w, const bf16 *x, long i0, long I) {
    float s = lanes32(acc);
    for (long i = i0; i < I; i++) s += bf16_float(w[i]) * bf16_float(x[i]);
    return s;
}

/* y (float32, or bf16 where yb is not NULL) as rows_N above; a step is 32 elements: one cache line of each of the
   R rows, and R lines of the next R rows prefetched in order (or of pf's walk, as rows_N). */
#define ROWS_B(N, R)                                                                                   \
    static void rowsb_##N(const bf16 *x, long ldx, const bf16 *w, long ldw, float *yf, bf16 *yb, long ldy, \
                          long o0, long o1, long I, const bf16 *pf, int pfs) {                         \
        const long iv = I / 32 * 32;                                                                   \
        long o = o0;                                                                                   \
        for (; o + R <= o1; o += R) {                                                                  \
            const bf16 *p = pf ? pf + (((o - o0) * ldw) >> pfs) : w + (o + R) * ldw;                   \
            accb acc[R][N];                                                                            \
            for (int r = 0; r < R; r++)                                                                \
                for (int j = 0; j < N; j++) acc[r][j] = zero32();                                      \
            for (long i = 0; i < iv; i += 32) {                                                        \
                for (int r = 0; r < R; r++) __builtin_prefetch(p + ((i * R + r * 32) >> pfs)); \
                for (int j = 0; j < N; j++)                                                            \
                    for (int r = 0; r < R; r++) acc[r][j] = dot32(w + (o + r) * ldw + i, x + j * ldx + i, acc[r][j]); \
            }                                                                                          \
            for (int r = 0; r < R; r++)                                                                \
                for (int j = 0; j < N; j++) {                                                          \
                    const float s = finish_b(acc[r][j], w + (o + r) * ldw, x + j * ldx, iv, I);        \
                    if (yb) yb[j * ldy + o + r] = float_bf16(s); else yf[j * ldy + o + r] = s;         \
                }                                                                                      \
        }                                                                                              \
        for (; o < o1; o++) {                                                                          \
            accb acc[N];                                                                               \
            for (int j = 0; j < N; j++) acc[j] = zero32();                                             \
            for (long i = 0; i < iv; i += 32)                                                          \
                for (int j = 0; j < N; j++) acc[j] = dot32(w + o * ldw + i, x + j * ldx + i, acc[j]);  \
            for (int j = 0; j < N; j++) {                                                              \
                const float s = finish_b(acc[j], w + o * ldw, x + j * ldx, iv, I);                     \
                if (yb) yb[j * ldy + o] = float_bf16(s); else yf[j * ldy + o] = s;                     \
            }                                                                                          \
        }                                                                                              \
    }

/* With AVX512-BF16 one row of x takes one weight row at a time, as float32 does (ROWS(1, 1) above): 22-25 GB/s at 4
   rows, 29-53 at one (as fast as a plain read of memory), one instruction a cache line. Widened, a cache line is four
   dependent FMAs, and one row at a time stays at 22 GB/s whatever memory gives; 4 rows at a time there, 29-37. */
#if defined(__AVX512BF16__) && defined(__AVX512F__) /* 32 vector registers: 24 accumulators for prefill's 6 rows */
ROWS_B(1, 1) ROWS_B(2, 4) ROWS_B(3, 4) ROWS_B(4, 3) ROWS_B(5, 4) ROWS_B(6, 4) ROWS_B(7, 1) ROWS_B(8, 1)
#else
ROWS_B(1, 4) ROWS_B(2, 4) ROWS_B(3, 4) ROWS_B(4, 3) ROWS_B(5, 2) ROWS_B(6, 2) ROWS_B(7, 1) ROWS_B(8, 1)
#endif

typedef void (*rowsb_fn)(const bf16 *, long, const bf16 *, long, float *, bf16 *, long, long, long, long, const bf16 *, int);
static const rowsb_fn ROWSB_FOR[9] = {0, rowsb_1, rowsb_2, rowsb_3, rowsb_4, rowsb_5, rowsb_6, rowsb_7, rowsb_8};

static void share_b(const bf16 *x, long ldx, const bf16 *w, long ldw, float *yf, bf16 *yb, long ldy, long n, long O,
                    long I, int t, int T) {
    long o0, o1;
    if (!thread_rows(O, t, T, &o0, &o1) || n == 0) return;
    if (n <= 8) {
        ROWSB_FOR[n](x, ldx, w, ldw, yf, yb, ldy, o0, o1, I, 0, 0);
        return;
    }
    const long C = (n + CHUNK - 1) / CHUNK;
    const int pfs = prefetch_shift(n);
    for (long b0 = o0; b0 < o1; b0 += BLOCK) {
        const long b1 = b0 + BLOCK < o1 ? b0 + BLOCK : o1, L = (b1 - b0) * ldw;
        for (long j0 = 0, c = 0; j0 < n; j0 += CHUNK, c++) {
            const long m = n - j0 < CHUNK ? n - j0 : CHUNK;
            ROWSB_FOR[m](x + j0 * ldx, ldx, w, ldw, yf ? yf + j0 * ldy : 0, yb ? yb + j0 * ldy : 0, ldy, b0, b1, I,
                         w + b1 * ldw + c * L / C, pfs);
        }
    }
}

void linear_nt_bf16(const bf16 *x, long ldx, const bf16 *w, long ldw, bf16 *y, long ldy, long n, long O, long I,
                    int threads) {
#pragma omp parallel num_threads(threads)
    share_b(x, ldx, w, ldw, 0, y, ldy, n, O, I, omp_get_thread_num(), omp_get_num_threads());
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
   that was a dozen operations around the one call (argsort, bincount, a gather, a scatter-add, ...), ~40 us of a
   decode step's layer. The sums are torch's (the tests hold the torch operations it replaced): the assignments
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

static inline float round_bf16(float f) { return bf16_float(float_bf16(f)); }

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

/* RMSNorm of n rows of D, one thread: y = x / sqrt(mean(x^2) + eps) * w, computed in float32 (bf16 rows widened,
   the result rounded once). torch's rms_norm on a CPU is half a dozen operations, ~45 us for one row of 512,
   and a decode step makes two per layer; this is a few microseconds, most of it the call. The sum of squares
   runs in 8 lanes, added left to right: a row's result does not depend on the rows beside it. */
static float rms_scale(const float *x, long D, float eps) {
    v8 acc = {0};
    const long dv = D / 8 * 8;
    for (long i = 0; i < dv; i += 8) {
        v8 xv = *(const v8 *)(x + i);
        acc = fma8(xv, xv, acc);
    }
    return 1.0f / sqrtf((finish(acc, x, x, dv, D)) / (float)D + eps);
}

void rms_norm(const float *x, const float *w, float *y, long n, long D, float eps) {
    for (long j = 0; j < n; j++) {
        const float *xj = x + j * D;
        const float r = rms_scale(xj, D, eps);
        for (long i = 0; i < D; i++) y[j * D + i] = xj[i] * r * w[i];
    }
}

void rms_norm_bf16(const bf16 *x, const bf16 *w, bf16 *y, long n, long D, float eps) {
    float xf[D];
    for (long j = 0; j < n; j++) {
        for (long i = 0; i < D; i++) xf[i] = bf16_float(x[j * D + i]);
        const float r = rms_scale(xf, D, eps);
        for (long i = 0; i < D; i++) y[j * D + i] = float_bf16(xf[i] * r * bf16_float(w[i]));
    }
}

/* Attention of one decode query per row over its slot of the KV cache, in place: row b's query heads
   q [B, H, Dh] against keys and values [slots, G, max_len, Dh] at slot slots[b], positions lo[b] .. hi[b] - 1
   (its causal window), query head h reading kv head h / (H / G). One pass with a running maximum (the
   softmax's rescaling as flash attention does it), scores and sums in float32. SDPA on a CPU cost 54-77 us a
   call at one query, plus gathering the rows' slots out of the cache and building the mask; this reads the
   cache where it lies. Each (row, head) is one thread's work, the same operations whatever the batch.

   With kn and vn (this step's keys and values [B, G, Dh]), they are first written at position hi[b] - 1 of
   each row's slot; with cs and sn (the rows' RoPE tables [B, Dh]), q and kn are rotated first (rotate-half:
   x cos + [-x2, x1] sin), rounded where torch's apply_rope rounds (each product and the sum, in T). That was a
   dozen torch operations and two indexed writes per layer around this call. */
#define ATTEND(NAME, T, LOAD8, LOAD1, STORE1, ROUND)                                                   \
    /* the work of the threads of an enclosing parallel region (its loops are orphaned omp for's), or of one */ \
    static void NAME##_rows(const T *q, const T *kn, const T *vn, const T *cs, const T *sn, T *k, T *v, T *y,    \
                            const long *slots, const long *lo, const long *hi, long B, long H, long G, long Dh,  \
                            long max_len, float scale) {                                               \
        const long dv = Dh / 8 * 8, per_slot = G * max_len * Dh, half = Dh / 2;                        \
        {                                                                                              \
            if (kn) {                                                                                  \
                _Pragma("omp for schedule(static)")                                                    \
                for (long bg = 0; bg < B * G; bg++) {                                                  \
                    const long b = bg / G, at = slots[b] * per_slot + (bg % G) * max_len * Dh + (hi[b] - 1) * Dh; \
                    const T *kb = kn + bg * Dh, *cb = cs ? cs + b * Dh : 0, *sb = sn ? sn + b * Dh : 0; \
                    for (long d = 0; d < Dh; d++) {                                                    \
                        v[at + d] = vn[bg * Dh + d];                                                   \
                        if (cs) STORE1(k + at, d, ROPE(kb, cb, sb, d, LOAD1, ROUND));                    \
                        else k[at + d] = kb[d];                                                        \
                    }                                                                                  \
                }                                                                                      \
            } /* the loop's end is a barrier: every key is written before any query reads */           \
            _Pragma("omp for schedule(static)")                                                        \
            for (long bh = 0; bh < B * H; bh++) {                                                      \
                const long b = bh / H, h = bh % H;                                                     \
                const T *qh = q + bh * Dh, *cb = cs ? cs + b * Dh : 0, *sb = sn ? sn + b * Dh : 0;  \
                const T *kh = k + slots[b] * per_slot + (h / (H / G)) * max_len * Dh;                  \
                const T *vh = v + slots[b] * per_slot + (h / (H / G)) * max_len * Dh;                  \
                float acc[Dh], qf[Dh], m = -INFINITY, sum = 0.0f;                                      \
                for (long d = 0; d < Dh; d++) acc[d] = 0.0f, qf[d] = cs ? ROPE(qh, cb, sb, d, LOAD1, ROUND) : LOAD1(qh, d); \
                for (long t = lo[b]; t < hi[b]; t++) {                                                 \
                    const T *kt = kh + t * Dh, *vt = vh + t * Dh;                                      \
                    v8 dot = {0};                                                                      \
                    for (long d = 0; d < dv; d += 8) dot = fma8(LOAD8(kt, d), *(const v8 *)(qf + d), dot); \
                    float s = 0.0f;                                                                    \
                    for (int l = 0; l < 8; l++) s += dot[l];                                           \
                    for (long d = dv; d < Dh; d++) s += LOAD1(kt, d) * qf[d];                          \
                    s *= scale;                                                                        \
                    if (s > m) { /* a new maximum: what was summed so far is scaled down to it */      \
                        const float c = expf(m - s);                                                   \
                        sum *= c;                                                                      \
                        for (long d = 0; d < Dh; d++) acc[d] *= c;                                     \
                        m = s;                                                                         \
                    }                                                                                  \
                    const float p = expf(s - m);                                                       \
                    sum += p;                                                                          \
                    for (long d = 0; d < Dh; d++) acc[d] += p * LOAD1(vt, d);                          \
                }                                                                                      \
                for (long d = 0; d < Dh; d++) STORE1(y + bh * Dh, d, sum > 0.0f ? acc[d] / sum : 0.0f); \
            }                                                                                          \
        }                                                                                              \
    }                                                                                                  \
    void NAME(const T *q, const T *kn, const T *vn, const T *cs, const T *sn, T *k, T *v, T *y, const long *slots, \
              const long *lo, const long *hi, long B, long H, long G, long Dh, long max_len, float scale,          \
              int threads) {                                                                           \
        _Pragma("omp parallel num_threads(threads)")                                                   \
        NAME##_rows(q, kn, vn, cs, sn, k, v, y, slots, lo, hi, B, H, G, Dh, max_len, scale);           \
    }

/* Element d of x (one head) rotated: x[d] cos[d] + (d < Dh/2 ? -x[d + Dh/2] : x[d - Dh/2]) sin[d], in float32,
   each product and the sum rounded to T as torch rounds them. */
#define ROPE(x, c, s, d, LOAD1, ROUND)                                                                 \
    ROUND(ROUND(LOAD1(x, d) * LOAD1(c, d))                                                             \
          + ROUND(((d) < half ? -LOAD1(x, (d) + half) : LOAD1(x, (d) - half)) * LOAD1(s, d)))

#define F32_LOAD8(p, d) (*(const v8 *)((p) + (d)))
#define F32_LOAD1(p, d) ((p)[d])
#define F32_STORE1(p, d, x) ((p)[d] = (x))
#define BF16_LOAD8(p, d) widen_any((p) + (d))
#define BF16_LOAD1(p, d) bf16_float((p)[d])
#define BF16_STORE1(p, d, x) ((p)[d] = float_bf16(x))

static inline v8 widen_any(const bf16 *p) { /* 8 bf16 -> 8 float32, on either side of the AVX512-BF16 probe */
    v8 r;
    for (int l = 0; l < 8; l++) r[l] = bf16_float(p[l]);
    return r;
}

#define F32_ROUND(x) (x)
ATTEND(attend_decode, float, F32_LOAD8, F32_LOAD1, F32_STORE1, F32_ROUND)
ATTEND(attend_decode_bf16, bf16, BF16_LOAD8, BF16_LOAD1, BF16_STORE1, round_bf16)

/* A decode layer's attention half in one call, for B rows of one token each: xn = RMSNorm(x), q k v = xn W^T,
   RoPE, the cache write and attention as attend_decode, h = x + attention Wo^T, hn = RMSNorm(h) (the MoE half's
   input). The same operations as those calls one by one, so the same numbers; what goes is what lay between
   them: per layer eight calls out of Python, each with its checks, its output tensor and a fork and join of
   the threads, and the Python around them running on caches the weights had just flushed (on the 644M Mixtral
   in bf16, 4-5 ms of a 17 ms token outside the C calls, against 1.4 ms when those calls did nothing). The weights
   are nn.Linear's [out, in] with contiguous rows; scratch holds B * (2D + 2(H + G)Dh) elements. */
static void gemv_f32(const float *x, const float *w, float *y, long n, long O, long I, int t, int T) {
    share(x, I, w, I, y, O, n, O, I, t, T);
}
static void gemv_bf16(const bf16 *x, const bf16 *w, bf16 *y, long n, long O, long I, int t, int T) {
    share_b(x, I, w, I, 0, y, O, n, O, I, t, T);
}
static inline float add_f32(float a, float b) { return a + b; }
static inline bf16 add_bf16(bf16 a, bf16 b) { return float_bf16(bf16_float(a) + bf16_float(b)); } /* torch's bf16 + */

#define DECODE_BLOCK(NAME, T, GEMV, RMS, ADD, ATTEND_ROWS)                                             \
    void NAME(const T *x, const T *n1, float eps1, const T *wq, const T *wk, const T *wv, const T *wo, const T *n2, \
              float eps2, const T *cs, const T *sn, T *kc, T *vc, const long *slots, const long *lo,   \
              const long *hi, long B, long D, long H, long G, long Dh, long max_len, float scale, T *scratch, \
              T *h, T *hn, int threads) {                                                              \
        T *xn = scratch, *q = xn + B * D, *kn = q + B * H * Dh, *vn = kn + B * G * Dh, *att = vn + B * G * Dh; \
        T *ao = att + B * H * Dh;                                                                      \
        _Pragma("omp parallel num_threads(threads)")                                                   \
        {                                                                                              \
            const int t = omp_get_thread_num(), nt = omp_get_num_threads();                            \
            _Pragma("omp single")                                                                      \
            RMS(x, n1, xn, B, D, eps1);                                                                \
            GEMV(xn, wq, q, B, H * Dh, D, t, nt);                                                      \
            GEMV(xn, wk, kn, B, G * Dh, D, t, nt);                                                     \
            GEMV(xn, wv, vn, B, G * Dh, D, t, nt);                                                     \
            _Pragma("omp barrier")                                                                     \
            ATTEND_ROWS(q, kn, vn, cs, sn, kc, vc, att, slots, lo, hi, B, H, G, Dh, max_len, scale); /* a barrier */ \
            GEMV(att, wo, ao, B, D, H * Dh, t, nt);                                                    \
            _Pragma("omp barrier")                                                                     \
            _Pragma("omp single")                                                                      \
            {                                                                                          \
                for (long i = 0; i < B * D; i++) h[i] = ADD(x[i], ao[i]);                              \
                RMS(h, n2, hn, B, D, eps2);                                                            \
            }                                                                                          \
        }                                                                                              \
    }

DECODE_BLOCK(decode_block, float, gemv_f32, rms_norm, add_f32, attend_decode_rows)
DECODE_BLOCK(decode_block_bf16, bf16, gemv_bf16, rms_norm_bf16, add_bf16, attend_decode_bf16_rows)

/* A router's choice from a token's E scores, in float32: softmax (Switch, Mixtral; renormalized over the K chosen
   where the config says) or sigmoid, of w x, or X-MoE's of the cosines of w x with the expert embeddings over tau
   (paper 000, eq. 6-7). The K largest, a tie to the lower id, and their gates, as routing.py computes them in
   torch up to the last bits of exp and of the sums (torch's vectorised exp is not libm's): the torch routers are
   the reference it is tested against. On the kernel this routes every token count, prefill and decode alike, so
   that a prompt's tokens route the same whichever path a step takes. An id is always in [0, E), NaN or not. */
enum { GATE_SOFTMAX = 0, GATE_SIGMOID = 1 };

struct router {
    const void *w;    /* [P, D] the gate (P = E), or X-MoE's projection (P = its routing dim R) */
    const float *emb; /* [E, R] X-MoE's expert embeddings as unit rows; NULL: the scores are w x itself */
    long P, E, K;
    float tau; /* the scores are divided by it (1 but for X-MoE) */
    int gate, renormalize;
};

static void choose(const float *wx, const struct router *r, long *ids, float *gates) {
    const long E = r->E, P = r->P;
    float s[E], p[E];
    if (r->emb) { /* cos(w x, e): w x over its norm (F.normalize's floor of 1e-12), dotted with the unit rows */
        float n2 = 0.0f;
        for (long i = 0; i < P; i++) n2 += wx[i] * wx[i];
        const float n = fmaxf(sqrtf(n2), 1e-12f);
        for (long e = 0; e < E; e++) {
            float d = 0.0f;
            for (long i = 0; i < P; i++) d += wx[i] / n * r->emb[e * P + i];
            s[e] = d;
        }
    } else {
        for (long e = 0; e < E; e++) s[e] = wx[e];
    }
    if (r->gate == GATE_SOFTMAX) {
        float m = -INFINITY, sum = 0.0f;
        for (long e = 0; e < E; e++) p[e] = s[e] / r->tau, m = p[e] > m ? p[e] : m;
        for (long e = 0; e < E; e++) p[e] = expf(p[e] - m), sum += p[e];
        for (long e = 0; e < E; e++) p[e] /= sum;
    } else {
        for (long e = 0; e < E; e++) p[e] = s[e]; /* ranked by score; the gate is sigmoid(s / tau) */
    }
    float total = 0.0f;
    for (long k = 0; k < r->K; k++) {
        long best = -1;
        for (long e = 0; e < E; e++) {
            int taken = 0;
            for (long j = 0; j < k; j++) taken |= ids[j] == e;
            if (!taken && (best < 0 || p[e] > p[best])) best = e;
        }
        ids[k] = best;
        gates[k] = r->gate == GATE_SOFTMAX ? p[best] : 1.0f / (1.0f + expf(-(p[best] / r->tau)));
        total += gates[k];
    }
    if (r->renormalize)
        for (long k = 0; k < r->K; k++) gates[k] /= total;
}

/* n tokens x [n, D] routed: ids [n, K] and gates [n, K] in x's dtype. w x is rounded to that dtype first, as
   the router's nn.Linear rounds it. Returns -2 where there is no memory for w x. */
#define ROUTE(NAME, T, LINEAR, WIDEN, NARROW)                                                          \
    int NAME(const T *x, long n, long D, const struct router *r, long *ids, T *gates, int threads) {   \
        const long P = r->P, K = r->K;                                                                 \
        T *wx = malloc((n * P + 1) * sizeof(T));                                                       \
        if (!wx) return -2;                                                                            \
        LINEAR(x, D, (const T *)r->w, D, wx, P, n, P, D, threads);                                     \
        for (long j = 0; j < n; j++) {                                                                 \
            float wf[P], g[K];                                                                         \
            for (long i = 0; i < P; i++) wf[i] = WIDEN(wx[j * P + i]);                                 \
            choose(wf, r, ids + j * K, g);                                                             \
            for (long k = 0; k < K; k++) gates[j * K + k] = NARROW(g[k]);                              \
        }                                                                                              \
        free(wx);                                                                                      \
        return 0;                                                                                      \
    }

static inline float same_f32(float f) { return f; }
ROUTE(route_tokens, float, linear_nt, same_f32, same_f32)
ROUTE(route_tokens_bf16, bf16, linear_nt_bf16, bf16_float, float_bf16)

/* A whole decode step of B rows (one token each) through every layer and the LM head, in one call: the rows'
   embeddings and RoPE angles looked up, then per layer decode_block, route_tokens and moe_ffn, and the residual
   sum; then the final RMSNorm and the head. The same calls Transformer.forward makes one by one on the kernel, so
   the same numbers; what goes is the Python between them. On the 644M Mixtral at batch 1 a weight-streaming step
   leaves every cache cold, and a small torch operation after it takes 50-260 us instead of 3-40: ~70 of them
   between the layers' calls were 1.8-2 ms of an 11 ms bf16 token; looking up the embedding, the RoPE rows and
   the attention bounds here rather than in torch took the time outside the call from 0.82 to 0.60 ms a token.
   Each layer's weights are where the model holds them (struct layer), the tables too (struct model); the cache
   is the call's, as decode_block takes it. Row b is token tokens[b] at position pos[b] of slot slots[b], seeing
   positions max(0, pos + 1 - window) .. pos (window 0: all). Out: logits [B, V], each layer's ids and gates
   [L, B, K] and expert counts [L, E]. Returns 0; -2 where there was no memory for the scratch; -3, before
   anything is written, where a token, slot or position is out of range. */
struct layer {
    const void *n1, *wq, *wk, *wv, *wo, *n2;
    float eps1, eps2;
    struct router router;
    const void *w1, *w3, *w2; /* the stacked experts, expert e at w + e * s (moe_ffn's) */
    long s1, s3, s2;
};

struct model {
    long L, D, H, G, Dh, F, V;
    const struct layer *layers;
    const void *norm, *head; /* the final RMSNorm's weight and the LM head [V, D] */
    float eps;
    const void *emb, *cos, *sin; /* the token embeddings [n_emb, D], the RoPE tables [n_pos, Dh] */
    long n_emb, n_pos, window;
};

#define DECODE_STEP(NAME, T, BLOCK, ROUTE_ROWS, MOE, ADD, RMS, LINEAR)                                 \
    int NAME(const struct model *m, const long *tokens, const long *slots, const long *pos, long B,    \
             T *const *kc, T *const *vc, long n_slots, long max_len, float scale, T *logits, long *ids, \
             T *gates, long *counts, int threads) {                                                    \
        const long D = m->D, H = m->H, G = m->G, Dh = m->Dh;                                           \
        for (long b = 0; b < B; b++)                                                                   \
            if (tokens[b] < 0 || tokens[b] >= m->n_emb || slots[b] < 0 || slots[b] >= n_slots ||       \
                pos[b] < 0 || pos[b] >= max_len || pos[b] >= m->n_pos)                                 \
                return -3;                                                                             \
        /* the bounds, 5 rows of D (the input, 4 of the layers'), the RoPE rows, decode_block's scratch */ \
        long *buf = malloc(2 * B * sizeof(long) + (B * (7 * D + 2 * Dh + 2 * (H + G) * Dh) + 1) * sizeof(T)); \
        if (!buf) return -2;                                                                           \
        long *lo = buf, *hi = lo + B;                                                                  \
        T *x = (T *)(hi + B), *a = x + B * D, *h = a + B * D, *hn = h + B * D, *y = hn + B * D;        \
        T *cs = y + B * D, *sn = cs + B * Dh, *scratch = sn + B * Dh;                                  \
        for (long b = 0; b < B; b++) {                                                                 \
            memcpy(x + b * D, (const T *)m->emb + tokens[b] * D, D * sizeof(T));                       \
            memcpy(cs + b * Dh, (const T *)m->cos + pos[b] * Dh, Dh * sizeof(T));                      \
            memcpy(sn + b * Dh, (const T *)m->sin + pos[b] * Dh, Dh * sizeof(T));                      \
            hi[b] = pos[b] + 1;                                                                        \
            lo[b] = m->window > 0 && hi[b] > m->window ? hi[b] - m->window : 0;                        \
        }                                                                                              \
        const T *cur = x;                                                                              \
        int status = 0;                                                                                \
        for (long l = 0; l < m->L; l++) {                                                              \
            const struct layer *ly = m->layers + l;                                                    \
            const long E = ly->router.E, K = ly->router.K;                                             \
            long *il = ids + l * B * K;                                                                \
            T *gl = gates + l * B * K;                                                                 \
            BLOCK(cur, ly->n1, ly->eps1, ly->wq, ly->wk, ly->wv, ly->wo, ly->n2, ly->eps2, cs, sn, kc[l], vc[l], \
                  slots, lo, hi, B, D, H, G, Dh, max_len, scale, scratch, h, hn, threads);             \
            status = ROUTE_ROWS(hn, B, D, &ly->router, il, gl, threads);                               \
            if (status == 0)                                                                           \
                status = MOE(hn, il, gl, B, K, ly->w1, ly->w3, ly->w2, ly->s1, ly->s3, ly->s2, y, E, D, m->F, \
                             threads);                                                                 \
            if (status) break;                                                                         \
            for (long i = 0; i < B * D; i++) a[i] = ADD(h[i], y[i]);                                   \
            for (long e = 0; e < E; e++) counts[l * E + e] = 0;                                        \
            for (long i = 0; i < B * K; i++) counts[l * E + il[i]]++;                                  \
            cur = a;                                                                                   \
        }                                                                                              \
        if (status == 0) {                                                                             \
            RMS(cur, m->norm, hn, B, D, m->eps);                                                       \
            LINEAR(hn, D, m->head, D, logits, m->V, B, m->V, D, threads);                              \
        }                                                                                              \
        free(buf);                                                                                     \
        return status;                                                                                 \
    }

DECODE_STEP(decode_step, float, decode_block, route_tokens, moe_ffn, add_f32, rms_norm, linear_nt)
DECODE_STEP(decode_step_bf16, bf16, decode_block_bf16, route_tokens_bf16, moe_ffn_bf16, add_bf16, rms_norm_bf16,
            linear_nt_bf16)
