/* linear_nt: y = x w^T, float32 and bfloat16, for w [O, I] stored row by row (nn.Linear's layout, no repacking).

   oneDNN and MKL stream a weight at memory speed for one row of x, but at two to eight rows (the rows
   one expert receives in a decode step of several sequences) they fall to half of it: their small-M
   GEMMs are not written for this. Here each thread walks its share of w's rows once, R at a time, and
   dots each with all n rows of x (which stay in cache), so w is read once whatever n is, at close to
   the speed of one row. Past 8 rows (prefill) the rows of x go 6 at a time over blocks of 24 rows of
   w that stay in the L2 cache: w is still read from memory once, and the next block is fetched while
   the rows of x go over this one (prefetch_shift). The measurements behind these choices are in
   docs/design-notes.md ("The CPU kernel's GEMM").

   Every output y[j, o] is the same sum in the same order (8-lane partial sums over i, the lanes added
   left to right, then the tail) whatever n, R or the thread count is: a row's result does not depend
   on which other rows share the call, so batching never changes a sequence's logits. */
#include "common.h"

int moeserve_kernel_abi(void) { return MOESERVE_KERNEL_ABI; }

/* Rows [o0, o1) of w against n = N rows of x, R rows of w at a time (N * R accumulators, kept near 12
   of the 16 vector registers), the rest of the range one row at a time. Prefetching keeps memory busy
   while the FMAs of several x rows run. It walks the next R rows as they lie in memory, one line after
   the other (R/2 lines a step, a step reading R * 32 bytes), rather than at the R offsets the loads
   read: R streams a page apart kept the hardware's prefetchers from streaming. Rows not contiguous (ldw > I): the walk covers part of the gaps
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
   order, one sequential read per thread, which the hardware prefetches best (4 rows at a time, 4 streams, is
   faster only on weights already in cache). A row's sum is the same either way: each weight row has its own accumulators. */
#if defined(__AVX512F__) /* 32 vector registers: 24 accumulators for prefill's 6 rows */
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
   of its own weight rows (2^pfs <= C: the shares overlap rather than leave gaps). Only the order of the reads changes, not a sum. */
static int prefetch_shift(long n) {
    const long C = (n + CHUNK - 1) / CHUNK;
    int pfs = 0;
    while ((2L << pfs) <= C) pfs++;
    return pfs;
}


void share(const float *x, long ldx, const float *w, long ldw, float *y, long ldy, long n, long O, long I,
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

/* bfloat16: the same GEMM on bf16 x and w, half the bytes to stream, the products summed in float32. Where the
   CPU has AVX512-BF16 (Zen 4, Sapphire Rapids), one instruction multiplies 32 pairs and adds them into 16
   float32 lanes; elsewhere each bf16 is widened to float32 (a shift) and summed by 8-lane FMAs, which is
   still half the bytes of float32 weights. Either way a row's result is the same sum in the same order
   whatever rows share the call. The output is rounded to bf16 (nearest even, as torch rounds), or kept in
   float32 where it feeds the activation (experts_ffn_bf16). */

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

/* With AVX512-BF16 one row of x takes one weight row at a time, as float32 does (ROWS(1, 1) above): one
   instruction a cache line keeps up with memory. Widened, a cache line is four dependent FMAs, and one row at
   a time falls behind memory; 4 rows at a time there. */
#if defined(__AVX512BF16__) && defined(__AVX512F__) /* 32 vector registers: 24 accumulators for prefill's 6 rows */
ROWS_B(1, 1) ROWS_B(2, 4) ROWS_B(3, 4) ROWS_B(4, 3) ROWS_B(5, 4) ROWS_B(6, 4) ROWS_B(7, 1) ROWS_B(8, 1)
#else
ROWS_B(1, 4) ROWS_B(2, 4) ROWS_B(3, 4) ROWS_B(4, 3) ROWS_B(5, 2) ROWS_B(6, 2) ROWS_B(7, 1) ROWS_B(8, 1)
#endif

typedef void (*rowsb_fn)(const bf16 *, long, const bf16 *, long, float *, bf16 *, long, long, long, long, const bf16 *, int);
static const rowsb_fn ROWSB_FOR[9] = {0, rowsb_1, rowsb_2, rowsb_3, rowsb_4, rowsb_5, rowsb_6, rowsb_7, rowsb_8};

void share_b(const bf16 *x, long ldx, const bf16 *w, long ldw, float *yf, bf16 *yb, long ldy, long n, long O,
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