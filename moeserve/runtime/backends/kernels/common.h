/* What the kernels' files share and do not export: float32 vectors, the one multiply-add, bf16 conversions, the
   split of a weight's rows between threads, and the internal entry points one op's file lends another (hidden:
   not part of the library's interface, which is moeserve_kernels.h). */
#ifndef MOESERVE_COMMON_H
#define MOESERVE_COMMON_H

#include <math.h>
#include <omp.h>
#include <stdlib.h>
#include <string.h>

#include "moeserve_kernels.h"

#define INTERNAL __attribute__((visibility("hidden")))

typedef float v8 __attribute__((vector_size(32), aligned(4))); /* unaligned loads: mmap'd weights */

/* acc + w * x, rounded the same way at every call site: built with -ffp-contract=off, so that the
   compiler never fuses a multiply-add in one loop and not in another. */
#if defined(__FMA__) && defined(__AVX__)
#include <immintrin.h>
static inline v8 fma8(v8 w, v8 x, v8 acc) { return (v8)_mm256_fmadd_ps((__m256)w, (__m256)x, (__m256)acc); }
#else
static inline v8 fma8(v8 w, v8 x, v8 acc) { return w * x + acc; }
#endif

/* An 8-lane dot product's end: the lanes added left to right, then the tail [i0, I) one product at a time. */
static inline float finish(v8 acc, const float *w, const float *x, long i0, long I) {
    float s = 0.0f;
    for (int k = 0; k < 8; k++) s += acc[k];
    for (long i = i0; i < I; i++) s += w[i] * x[i];
    return s;
}

static inline float bf16_float(bf16 h) {
    union { unsigned u; float f; } c = {(unsigned)h << 16};
    return c.f;
}

static inline bf16 float_bf16(float f) { /* nearest even, as torch rounds */
    union { float f; unsigned u; } c = {f};
    if ((c.u & 0x7fffffffu) > 0x7f800000u) return (bf16)((c.u >> 16) | 0x40); /* NaN stays a (quiet) NaN */
    return (bf16)((c.u + 0x7fffu + ((c.u >> 16) & 1u)) >> 16);
}

static inline float round_bf16(float f) { return bf16_float(float_bf16(f)); }

/* Thread t of T's rows [*o0, *o1) of w's O: blocks of 12, a multiple of every R of gemm.c. Whether it has any. */
static inline int thread_rows(long O, int t, int T, long *o0, long *o1) {
    const long per = (O + T - 1) / T, part = (per + 11) / 12 * 12;
    *o0 = t * part;
    *o1 = *o0 + part < O ? *o0 + part : O;
    return *o0 < *o1;
}

/* gemm.c: thread t of T's share of x [n, I] (row stride ldx) @ w [O, I]^T (row stride ldw) -> y [n, O] (row stride
   ldy), for ops that run their GEMMs inside their own parallel region. share_b writes float32 yf, or bf16 yb where
   yb is not NULL. */
INTERNAL void share(const float *x, long ldx, const float *w, long ldw, float *y, long ldy, long n, long O, long I,
                    int t, int T);
INTERNAL void share_b(const bf16 *x, long ldx, const bf16 *w, long ldw, float *yf, bf16 *yb, long ldy, long n, long O,
                      long I, int t, int T);

/* attention.c: attend_decode's work for the threads of an enclosing parallel region (its loops are orphaned omp
   for's, the last one ending in a barrier). */
INTERNAL void attend_decode_rows(const float *q, const float *kn, const float *vn, const float *cs, const float *sn,
                                 float *k, float *v, float *y, const long *slots, const long *lo, const long *hi,
                                 long B, long H, long G, long Dh, long max_len, float scale);
INTERNAL void attend_decode_bf16_rows(const bf16 *q, const bf16 *kn, const bf16 *vn, const bf16 *cs, const bf16 *sn,
                                      bf16 *k, bf16 *v, bf16 *y, const long *slots, const long *lo, const long *hi,
                                      long B, long H, long G, long Dh, long max_len, float scale);

/* quant.c: activations quantized per 32-element block (its comment has the arithmetic): n rows of I at q + j I,
   their scales at d + j nbs (nbs: the blocks rounded up to a multiple of 4, the extra ones 0), int4's correction
   lanes at c + j nbs, and where the build has AVX2 or AVX512 the int4 kernel's copy of q at q4 + j 32 nbs (see
   quant.c).
   qx_bytes(n, I) bytes hold them (qx_at lays them out, qx_rows(p, r) is rows r.. of p); quantize_rows(_b) fills
   thread t of T's rows (a barrier must follow before share_q reads them). */
typedef signed char i8;
typedef int i32x8 __attribute__((vector_size(32)));
struct qx {
    i32x8 *c;
    float *d;
    i8 *q, *q4;
    float *dq; /* AVX2's int4 (quant.c's Q4Y): each block's d four times, at dq + j 4 nbs; else NULL */
    long I, nbs;
};
INTERNAL struct qx qx_rows(const struct qx *p, long r0);
INTERNAL long qx_bytes(long n, long I);
INTERNAL struct qx qx_at(void *mem, long n, long I);
INTERNAL void quantize_rows(const float *x, long ldx, long n, struct qx *p, int t, int T);
INTERNAL void quantize_rows_b(const bf16 *x, long ldx, long n, struct qx *p, int t, int T);
/* 1 where fmt (QUANT_INT8, QUANT_INT4 or QUANT_INT6) and group suit a width I (a multiple of 32; int4's and int6's
   group a multiple of 32 dividing I; int6's I a multiple of 128) */
INTERNAL int quant_format_ok(int fmt, long group, long I);
/* thread t of T's share of x (prepared) @ w^T -> float32 yf, or bf16 yb where yb is not NULL (row stride ldy):
   w int8 [O, I] with float32 scale [O], or int4 uint8 [O, I/2] (int6 [O, 3I/4]) with float16 scale [O, I/group]. */
INTERNAL void share_q(const struct qx *x, long n, const void *w, const void *scale, int fmt, long group, float *yf,
                      bf16 *yb, long ldy, long O, int t, int T);

#endif
