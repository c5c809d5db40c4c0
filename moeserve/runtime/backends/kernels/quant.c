/* linear_q: y = x w^T on quantized weights (runtime/quant.py's int8 and int4 formats), x float32 or bf16.

   How the products are taken was decided by measurement (issue 39; the tables are in docs/bench/log.md, "The
   quantized kernels"): widening the weights to float32 in registers and multiplying them by FMAs was compute-bound
   at half (int8) and a quarter to a half (int4) of the speed of quantizing the activations to int8 per 32-element
   block and taking integer dot products (llama.cpp's Q8_0 x Q8_0: VNNI's vpdpbusd where the CPU has it, maddubs +
   madd on plain AVX2), each block's integer sum scaled in float32. So the latter, for both formats. int8 then
   streams at memory's pace; int4 on AVX512 takes four blocks a 512-bit step (Q4X below), which made it match
   memory at one row; from four rows on it is compute-bound. int4 on AVX2 (Q4Y) takes four blocks a step too, as two
   pairs on 256-bit vectors, which brought it to memory's pace at one row (it had been one block a step, compute-bound
   at about two thirds of that; docs/bench/log.md).

   The arithmetic, exactly (quant_kernel.reference_linear_q computes the same in torch):
     - each row of x (bf16 widened to float32 exactly) is cut in blocks of 32; per block d = amax|x| / 127 (float32
       division) and q = round-half-even(x / d) (float32 division, |q| <= 127), q = 0 where d = 0;
     - per block and weight row the integer sum s = sum q * v, v the weight's integer (int8: q_w; int4: u - 8),
       exact in int32;
     - int8: y = scale[o] * sum_b d_b s_b;  int4: y = sum_b (d_b scale[o, b*32/G]) s_b;  the float sums in float32
       (8 lanes of partial sums, blocks paired as ROWS_Q8 says, the lanes added left to right at the end; Q4X's
       int4: 16 lanes, each an exact int32 part of one block's s_b times that block's d_b scale_b, added by
       _mm512_reduce_add_ps at the end; Q4Y's: 8 lanes, each an exact int32 part of one block's s_b times d_b scale_b,
       added left to right at the end), rounded once to bf16 for a bf16 x.
   Only the float32 order of the last step differs from a torch reference, so the two agree to float rounding.
   Each row of x has its own accumulators, in the same order whatever n, the thread count or the block is: a row's
   result does not depend on which other rows share the call (batch invariance, as gemm.c). */
#include "common.h"

#if defined(__AVX2__) || defined(__F16C__)
#include <immintrin.h>
#endif

typedef unsigned char u8;

/* IEEE half -> float, exactly (the int4 scales). */
static inline float half_float(unsigned short h) {
#if defined(__F16C__)
    return _cvtsh_ss(h);
#else
    const unsigned s = (h & 0x8000u) << 16, e = (h >> 10) & 0x1fu, m = h & 0x3ffu;
    union { unsigned u; float f; } c;
    if (e == 0) {
        c.f = (float)m * 5.9604644775390625e-8f; /* subnormal or zero: m 2^-24, exact */
        c.u |= s;
    } else {
        c.u = s | (e == 31 ? 0x7f800000u | (m << 13) : ((e + 112) << 23) | (m << 13));
    }
    return c.f;
#endif
}

static inline float lanes8(v8 acc) { /* left to right, as finish() */
    float s = 0.0f;
    for (int k = 0; k < 8; k++) s += acc[k];
    return s;
}

/* ---- the activations, quantized ----------------------------------------------------------------------------- */

/* Q4X: AVX512 with VNNI (and F16C): int4 takes four blocks a step (see q4x below), from its own copy q4 of the
   activations' integers, laid out as those steps read them, and correction lanes c per four blocks. */
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__) && defined(__F16C__)
#define Q4X 1
#else
#define Q4X 0
#endif
/* Q4Y: AVX2 (with F16C and FMA) where there is no Q4X: int4 takes four blocks a step on 256-bit vectors (see ROWS_Q4
   below), from its own copy q4 of the activations' integers laid out per pair of blocks, the correction lanes c per
   pair, and each block's d spread over four lanes (dq). */
#if !Q4X && defined(__AVX2__) && defined(__F16C__) && defined(__FMA__)
#define Q4Y 1
#else
#define Q4Y 0
#endif

static inline long blocks_stored(long I) { return (I / 32 + 3) / 4 * 4; }

long qx_bytes(long n, long I) {
    const long nbs = blocks_stored(I);
    return n * (I + nbs * (long)(sizeof(float) + sizeof(i32x8) + (Q4X || Q4Y ? 32 : 0) + (Q4Y ? 16 : 0))) + 128;
}

struct qx qx_at(void *mem, long n, long I) {
    const long nbs = blocks_stored(I);
    char *p = (char *)(((unsigned long)mem + 63) & ~63ul); /* the correction lanes first: 64-byte aligned */
    struct qx r = {.c = (i32x8 *)p, .I = I, .nbs = nbs};
    p += n * nbs * sizeof(i32x8);
    r.q4 = Q4X || Q4Y ? (i8 *)p : 0;
    p += Q4X || Q4Y ? n * nbs * 32 : 0;
    r.dq = Q4Y ? (float *)p : 0;
    p += Q4Y ? n * nbs * 16 : 0;
    r.d = (float *)p;
    r.q = (i8 *)(r.d + n * nbs);
    return r;
}

struct qx qx_rows(const struct qx *p, long r0) {
    struct qx r = *p;
    r.c += r0 * p->nbs, r.d += r0 * p->nbs, r.q += r0 * p->I;
    if (r.q4) r.q4 += r0 * p->nbs * 32;
    if (r.dq) r.dq += r0 * p->nbs * 4;
    return r;
}

/* One block b of a row (32 floats at xb): q and d (see the top), and int4's correction lanes, so that
   sum (u - 8) q comes out of the unsigned u directly. Without Q4X or Q4Y, c[b] is 8 lanes, lane k -8 (q[4k] + .. +
   q[4k + 3]). With Q4X, per four blocks b = 4g + k (k < 4) one 16-lane c and 128 bytes of q4: lane 4i + k of the
   first 64 bytes holds q[4i .. 4i + 3] of block 4g + k, of the second q[16 + 4i .. 16 + 4i + 3], and c's lane
   4i + k is -8 times the sum of both. With Q4Y, per pair of blocks b = 2p + k (k < 2) 8 lanes of c and 64 bytes
   of q4: q[0 .. 15] of block 2p + k at 16 k, q[16 .. 31] at 32 + 16 k, and c's lane 4k + i is -8 times the sum of
   q[4i .. 4i + 3] and q[16 + 4i .. 16 + 4i + 3]; dq[4b .. 4b + 3] = d[b]. */
static void quantize_block(const float *xb, long b, i8 *q, float *d, i32x8 *c, i8 *q4, float *dq) {
#if Q4X
    const __m512 x0 = _mm512_loadu_ps(xb), x1 = _mm512_loadu_ps(xb + 16);
    const float dd = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(x0), _mm512_abs_ps(x1))) / 127.0f;
    d[b] = dd;
    (void)dq;
    __m512i v0 = _mm512_setzero_si512(), v1 = v0;
    if (dd > 0) {
        const __m512 dv = _mm512_set1_ps(dd); /* true divisions, as torch's; rounded half to even */
        v0 = _mm512_cvtps_epi32(_mm512_roundscale_ps(_mm512_div_ps(x0, dv), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
        v1 = _mm512_cvtps_epi32(_mm512_roundscale_ps(_mm512_div_ps(x1, dv), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
    }
    const __m128i b0 = _mm512_cvtepi32_epi8(v0), b1 = _mm512_cvtepi32_epi8(v1);
    _mm_storeu_si128((__m128i *)(q + b * 32), b0);
    _mm_storeu_si128((__m128i *)(q + b * 32 + 16), b1);
    int s[16];
    _mm512_storeu_si512(s, _mm512_add_epi32(v0, v1)); /* q[m] + q[16 + m] */
    const long g = b / 4, k = b % 4;
    int *cl = (int *)c + g * 16, w0[4], w1[4];
    _mm_storeu_si128((__m128i *)w0, b0);
    _mm_storeu_si128((__m128i *)w1, b1);
    i8 *lo = q4 + g * 128;
    for (int i = 0; i < 4; i++) {
        cl[4 * i + k] = -8 * (s[4 * i] + s[4 * i + 1] + s[4 * i + 2] + s[4 * i + 3]);
        memcpy(lo + (4 * i + k) * 4, w0 + i, 4);
        memcpy(lo + 64 + (4 * i + k) * 4, w1 + i, 4);
    }
#else
    float amax = 0.0f;
    for (int k = 0; k < 32; k++) {
        const float a = fabsf(xb[k]);
        amax = a > amax ? a : amax;
    }
    const float dd = amax / 127.0f;
    const v8 dv = {dd, dd, dd, dd, dd, dd, dd, dd};
    d[b] = dd;
    i8 *qb = q + b * 32;
    int s4[8] = {0}; /* sums of four */
    for (int k = 0; k < 32; k += 8) {
        v8 r = {0};
        if (dd > 0) {
            r = *(const v8 *)(xb + k) / dv; /* a true division, as torch's */
#if defined(__AVX__)
            r = (v8)_mm256_round_ps((__m256)r, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); /* half to even */
#else
            for (int l = 0; l < 8; l++) r[l] = nearbyintf(r[l]);
#endif
        }
        const i32x8 v = __builtin_convertvector(r, i32x8);
        for (int l = 0; l < 8; l++) {
            qb[k + l] = (i8)v[l];
            s4[(k + l) / 4] += v[l];
        }
    }
#if Q4Y
    i8 *qp = q4 + b / 2 * 64 + b % 2 * 16;
    memcpy(qp, qb, 16), memcpy(qp + 32, qb + 16, 16);
    int *cp = (int *)c + b / 2 * 8 + b % 2 * 4;
    for (int i = 0; i < 4; i++) cp[i] = -8 * (s4[i] + s4[4 + i]), dq[4 * b + i] = dd;
#else
    (void)q4, (void)dq;
    i32x8 cl;
    for (int l = 0; l < 8; l++) cl[l] = -8 * s4[l];
    c[b] = cl;
#endif
#endif
}

/* the blocks past a row's last, up to nbs: zeros (they add nothing) */
static void pad_row(long nb, long nbs, float *d, i32x8 *c, i8 *q4, float *dq) {
    for (long b = nb; b < nbs; b++) {
        d[b] = 0.0f;
#if Q4X
        (void)dq;
        const long g = b / 4, k = b % 4;
        for (int i = 0; i < 4; i++) {
            ((int *)c)[g * 16 + 4 * i + k] = 0;
            memset(q4 + g * 128 + (4 * i + k) * 4, 0, 4);
            memset(q4 + g * 128 + 64 + (4 * i + k) * 4, 0, 4);
        }
#elif Q4Y
        memset(q4 + b / 2 * 64 + b % 2 * 16, 0, 16), memset(q4 + b / 2 * 64 + 32 + b % 2 * 16, 0, 16);
        memset((int *)c + b / 2 * 8 + b % 2 * 4, 0, 16), memset(dq + 4 * b, 0, 16);
#else
        (void)q4, (void)dq;
        c[b] = (i32x8){0};
#endif
    }
}

#define ROW_PTRS(j) p->q + (j) * p->I, p->d + (j) * nbs, p->c + (j) * nbs, p->q4 ? p->q4 + (j) * nbs * 32 : 0, \
                    p->dq ? p->dq + (j) * nbs * 4 : 0

void quantize_rows(const float *x, long ldx, long n, struct qx *p, int t, int T) {
    const long nb = p->I / 32, nbs = p->nbs;
    for (long j = t; j < n; j += T) {
        for (long b = 0; b < nb; b++) quantize_block(x + j * ldx + b * 32, b, ROW_PTRS(j));
        pad_row(nb, nbs, p->d + j * nbs, p->c + j * nbs, p->q4 ? p->q4 + j * nbs * 32 : 0,
                p->dq ? p->dq + j * nbs * 4 : 0);
    }
}

void quantize_rows_b(const bf16 *x, long ldx, long n, struct qx *p, int t, int T) {
    const long nb = p->I / 32, nbs = p->nbs;
    float buf[32] __attribute__((aligned(32)));
    for (long j = t; j < n; j += T) {
        for (long b = 0; b < nb; b++) {
            for (int k = 0; k < 32; k++) buf[k] = bf16_float(x[j * ldx + b * 32 + k]);
            quantize_block(buf, b, ROW_PTRS(j));
        }
        pad_row(nb, nbs, p->d + j * nbs, p->c + j * nbs, p->q4 ? p->q4 + j * nbs * 32 : 0,
                p->dq ? p->dq + j * nbs * 4 : 0);
    }
}

/* ---- one block's integer dot products ------------------------------------------------------------------------ */

/* 8 lanes, lane k = acc[k] + sum over elements 4k .. 4k + 3 of u * q (u unsigned bytes, q signed, |u q| < 2^14:
   maddubs's int16 pairs cannot saturate). */
#if defined(__AVX2__)
typedef __m256i b32;
static inline b32 load32(const void *p) { return _mm256_loadu_si256((const __m256i *)p); }
static inline i32x8 dot_u8i8(i32x8 acc, b32 u, b32 q) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
    return (i32x8)_mm256_dpbusd_epi32((__m256i)acc, u, q);
#elif defined(__AVXVNNI__)
    return (i32x8)_mm256_dpbusd_avx_epi32((__m256i)acc, u, q);
#else
    return (i32x8)_mm256_add_epi32((__m256i)acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u, q), _mm256_set1_epi16(1)));
#endif
}
/* int8 weights w: |w| times q with w's sign (the sign trick: maddubs and vpdpbusd take one unsigned side) */
static inline i32x8 dot_i8(b32 w, b32 aw, b32 q) { return dot_u8i8((i32x8){0}, aw, _mm256_sign_epi8(q, w)); }
static inline b32 abs8(b32 w) { return _mm256_abs_epi8(w); }
/* 16 bytes of int4 nibbles -> 32 unsigned bytes in element order (low nibbles 0..15, high 16..31) */
static inline b32 unpack4(const u8 *p) {
    const __m128i b = _mm_loadu_si128((const __m128i *)p), m = _mm_set1_epi8(15);
    return _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(b, 4), m), _mm_and_si128(b, m));
}
static inline v8 to_float(i32x8 l) { return (v8)_mm256_cvtepi32_ps((__m256i)l); }
#else /* the same lanes in plain C */
typedef struct { signed char b[32]; } b32;
static inline b32 load32(const void *p) { b32 r; memcpy(&r, p, 32); return r; }
static inline i32x8 dot_u8i8(i32x8 acc, b32 u, b32 q) {
    for (int k = 0; k < 32; k++) acc[k / 4] += (u8)u.b[k] * q.b[k];
    return acc;
}
static inline i32x8 dot_i8(b32 w, b32 aw, b32 q) {
    i32x8 acc = {0};
    (void)aw;
    for (int k = 0; k < 32; k++) acc[k / 4] += w.b[k] * q.b[k];
    return acc;
}
static inline b32 abs8(b32 w) { return w; }
static inline b32 unpack4(const u8 *p) {
    b32 r;
    for (int k = 0; k < 16; k++) r.b[k] = p[k] & 15, r.b[k + 16] = p[k] >> 4;
    return r;
}
static inline v8 to_float(i32x8 l) { return __builtin_convertvector(l, v8); }
#endif

static inline v8 splat(float f) { return (v8){f, f, f, f, f, f, f, f}; }

/* A row's bytes per 128 elements: int4 64 (nibbles), int6 96 (the nibbles, then 32 bytes of the high two bits, as
   runtime/quant.py's pack_int6 lays them out); XB the high bits a weight has past its nibble (0 or 2). */
#define CHUNK(XB) (64 + 16 * (XB))

/* Block b of a row at wr (32 elements) as 32 unsigned bytes in element order: its nibbles (unpack4), with int6's
   high bits ORed in byte by byte (the plain-C path's; the vector paths take whole chunks). */
static inline b32 unpack_block(const u8 *wr, long b, int XB) {
    const u8 *nib = wr + b / 4 * CHUNK(XB) + b % 4 * 16;
    if (!XB) return unpack4(nib);
    u8 u[32];
    for (int k = 0; k < 16; k++) {
        const long m = b % 4 * 16 + k; /* the nibble byte's place in its chunk */
        const int e = wr[b / 4 * CHUNK(XB) + 64 + m % 32] >> (4 * (m / 32));
        u[k] = (u8)((nib[k] & 15) | (e & 3) << 4), u[k + 16] = (u8)((nib[k] >> 4) | (e >> 2 & 3) << 4);
    }
    return load32(u);
}

static inline void store(float *yf, bf16 *yb, long at, float s) {
    if (yb) yb[at] = float_bf16(s); else yf[at] = s;
}

/* Rows [o0, o1) of w against N rows of x (x's row j at q + j I, its scales at d + j nb), one weight row at a time:
   it streams in order, which the hardware prefetches best; the next row is prefetched too. Blocks go in pairs, each
   pair's two scaled sums added together before they join the row's accumulator (t = s0 l0 + s1 l1; acc += t): one
   dependent add a pair rather than an FMA a block, whose latency had kept one row of int4 at the speed of bf16.
   An odd last block joins by an FMA. The same per row whatever N, so a row's result does not depend on N. */
#ifndef Q8_PF /* bytes ahead: 4 KB where the rows are few (memory-bound), a row where they are many (measured) */
#define Q8_PF(N) ((N) <= 2 ? 4096 : ldw)
#endif
#define PAIR(acc, l0, s0, l1, s1) (acc) = (acc) + fma8(to_float(l1), splat(s1), to_float(l0) * splat(s0))
#define ROWS_Q8(N)                                                                                     \
    static void q8_##N(const struct qx *x, long j0, const i8 *w, long ldw, const float *sc, float *yf, bf16 *yb, \
                       long ldy, long o0, long o1) {                                                   \
        const long I = x->I, nb = I / 32, nbs = x->nbs;                                                \
        const i8 *q = x->q + j0 * I;                                                                   \
        const float *d = x->d + j0 * nbs;                                                              \
        for (long o = o0; o < o1; o++) {                                                               \
            const i8 *wr = w + o * ldw;                                                                \
            v8 acc[N];                                                                                 \
            for (int j = 0; j < N; j++) acc[j] = (v8){0};                                              \
            long b = 0;                                                                                \
            for (; b + 1 < nb; b += 2) {                                                               \
                __builtin_prefetch(wr + Q8_PF(N) + b * 32);                                                 \
                const b32 w0 = load32(wr + b * 32), a0 = abs8(w0), w1 = load32(wr + b * 32 + 32), a1 = abs8(w1); \
                for (int j = 0; j < N; j++) {                                                          \
                    const i32x8 l0 = dot_i8(w0, a0, load32(q + j * I + b * 32));                       \
                    const i32x8 l1 = dot_i8(w1, a1, load32(q + j * I + b * 32 + 32));                  \
                    PAIR(acc[j], l0, d[j * nbs + b], l1, d[j * nbs + b + 1]);                            \
                }                                                                                      \
            }                                                                                          \
            if (b < nb) {                                                                              \
                const b32 w0 = load32(wr + b * 32), a0 = abs8(w0);                                     \
                for (int j = 0; j < N; j++)                                                            \
                    acc[j] = fma8(to_float(dot_i8(w0, a0, load32(q + j * I + b * 32))), splat(d[j * nbs + b]), acc[j]); \
            }                                                                                          \
            for (int j = 0; j < N; j++) store(yf, yb, j * ldy + o, lanes8(acc[j]) * sc[o]);            \
        }                                                                                              \
    }

#if Q4Y
#ifndef Q4_PF
#define Q4_PF 4096 /* bytes ahead, as Q4X's */
#endif
/* 8 lanes: c + the sums over four of l's bytes times ql's and four of h's times qh's (u unsigned, q signed; the
   int16 pairs of maddubs are at most 2 * 15 * 127 each, so their sum of two cannot saturate either) */
static inline __m256i dot_pair(__m256i c, __m256i l, __m256i ql, __m256i h, __m256i qh) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
    return _mm256_dpbusd_epi32(_mm256_dpbusd_epi32(c, l, ql), h, qh);
#elif defined(__AVXVNNI__)
    return _mm256_dpbusd_avx_epi32(_mm256_dpbusd_avx_epi32(c, l, ql), h, qh);
#else
    const __m256i s = _mm256_add_epi16(_mm256_maddubs_epi16(l, ql), _mm256_maddubs_epi16(h, qh));
    return _mm256_add_epi32(c, _mm256_madd_epi16(s, _mm256_set1_epi16(1)));
#endif
}
/* Q4Y: four blocks a step (64 bytes of nibbles) as two pairs. A pair's 32 bytes hold block 2p's 16 in the low
   128-bit lane and 2p + 1's in the high one, so their low nibbles (elements 0..15 of each) and high nibbles
   (16..31) meet q4's pair layout as they lie: lane 4k + i of dot_pair is the exact sum over eight of block
   2p + k's elements of (u - 8) q (from c). Per lane, in float32: acc += float(lane) (scale_b d_b), the four scales
   converted by F16C and spread over the pairs' lanes by a permute, the d's read spread (dq); at the row's end the
   8 lanes added left to right. The last step of a row whose blocks are not a multiple of 4 reads its nibbles and
   scales from a copy padded with zeros (nothing past the row is read), its missing blocks having q = c = d = 0.
   The same for every x row whatever N, so a row's result does not depend on N. */
#define ROWS_Q4(N, NAME, XB)                                                                           \
    static void NAME##_##N(const struct qx *x, long j0, const u8 *w, long ldw, const unsigned short *sc, long G, \
                           float *yf, bf16 *yb, long ldy, long o0, long o1) {                          \
        const long I = x->I, nb = I / 32, ng = I / G, per = G / 32, nbs = x->nbs, full = nb / 4, ng4 = nbs / 4; \
        const i8 *q = x->q4 + j0 * nbs * 32;                                                           \
        const float *dq = x->dq + j0 * nbs * 4;                                                        \
        const int *c = (const int *)(x->c + j0 * nbs);                                                 \
        const __m256i m15 = _mm256_set1_epi8(15), m3 = _mm256_set1_epi8(3);                            \
        const __m256i at01 = _mm256_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1);                               \
        const __m256i at23 = _mm256_setr_epi32(2, 2, 2, 2, 3, 3, 3, 3);                               \
        unsigned short hbuf[per == 1 ? 4 : nbs], htail[4];                                            \
        u8 ntail[64];                                                                                  \
        for (long o = o0; o < o1; o++) {                                                               \
            const u8 *wr = w + o * ldw;                                                                \
            const unsigned short *hs = sc + o * ng;                                                    \
            if (per > 1) {                                                                             \
                for (long b = 0; b < nb; b++) hbuf[b] = hs[b / per];                                   \
                for (long b = nb; b < nbs; b++) hbuf[b] = 0;                                           \
                hs = hbuf;                                                                             \
            }                                                                                          \
            __m256 acc[N];                                                                             \
            for (int j = 0; j < N; j++) acc[j] = _mm256_setzero_ps();                                  \
            for (long g = 0; g < ng4; g++) {                                                           \
                const long b = 4 * g;                                                                  \
                const u8 *wg = wr + g * CHUNK(XB);                                                     \
                const unsigned short *hg = hs + b;                                                     \
                _mm_prefetch((const char *)(wg + Q4_PF), _MM_HINT_T0);                                 \
                if (g >= full) { /* the row's last, partial, step */                                  \
                    memset(ntail, 0, 64), memcpy(ntail, wg, (nb - b) * 16), wg = ntail;                \
                    if (per == 1) {                                                                    \
                        memset(htail, 0, 8), memcpy(htail, hg, (nb - b) * 2), hg = htail;              \
                    }                                                                                  \
                }                                                                                      \
                const __m256i n0 = _mm256_loadu_si256((const __m256i *)wg);                            \
                const __m256i n1 = _mm256_loadu_si256((const __m256i *)(wg + 32));                     \
                __m256i l0 = _mm256_and_si256(n0, m15), h0 = _mm256_and_si256(_mm256_srli_epi16(n0, 4), m15); \
                __m256i l1 = _mm256_and_si256(n1, m15), h1 = _mm256_and_si256(_mm256_srli_epi16(n1, 4), m15); \
                if (XB) { /* int6: crumb byte k's bits 0-3 complete nibble byte k, its bits 4-7 byte k + 32 */ \
                    const __m256i e0 = _mm256_loadu_si256((const __m256i *)(wg + 64)), e1 = _mm256_srli_epi16(e0, 4); \
                    l0 = _mm256_or_si256(l0, _mm256_slli_epi16(_mm256_and_si256(e0, m3), 4));           \
                    h0 = _mm256_or_si256(h0, _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(e0, 2), m3), 4)); \
                    l1 = _mm256_or_si256(l1, _mm256_slli_epi16(_mm256_and_si256(e1, m3), 4));           \
                    h1 = _mm256_or_si256(h1, _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(e1, 2), m3), 4)); \
                }                                                                                      \
                const __m256 s4 = _mm256_castps128_ps256(_mm_cvtph_ps(_mm_loadl_epi64((const __m128i *)hg))); \
                const __m256 s01 = _mm256_permutevar8x32_ps(s4, at01), s23 = _mm256_permutevar8x32_ps(s4, at23); \
                for (int j = 0; j < N; j++) {                                                          \
                    const __m256i *qj = (const __m256i *)(q + j * nbs * 32 + g * 128);                 \
                    const int *cj = c + j * nbs * 8 + g * 16;                                          \
                    const float *dj = dq + j * nbs * 4 + g * 16;                                       \
                    const __m256i c0 = _mm256_slli_epi32(_mm256_loadu_si256((const __m256i *)cj), XB);  \
                    const __m256i c1 = _mm256_slli_epi32(_mm256_loadu_si256((const __m256i *)(cj + 8)), XB); \
                    const __m256i a0 = dot_pair(c0, l0, _mm256_loadu_si256(qj), h0, _mm256_loadu_si256(qj + 1)); \
                    const __m256i a1 = dot_pair(c1, l1, _mm256_loadu_si256(qj + 2), h1, _mm256_loadu_si256(qj + 3)); \
                    const __m256 sd0 = _mm256_mul_ps(s01, _mm256_loadu_ps(dj));                        \
                    const __m256 sd1 = _mm256_mul_ps(s23, _mm256_loadu_ps(dj + 8));                    \
                    acc[j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(a0), sd0, acc[j]);                     \
                    acc[j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(a1), sd1, acc[j]);                     \
                }                                                                                      \
            }                                                                                          \
            for (int j = 0; j < N; j++) store(yf, yb, j * ldy + o, lanes8((v8)acc[j]));                \
        }                                                                                              \
    }

#elif !Q4X
#define ROWS_Q4(N, NAME, XB)                                                                           \
    static void NAME##_##N(const struct qx *x, long j0, const u8 *w, long ldw, const unsigned short *sc, long G, \
                           float *yf, bf16 *yb, long ldy, long o0, long o1) {                          \
        const long I = x->I, nb = I / 32, ng = I / G, per = G / 32, nbs = x->nbs;                      \
        const i8 *q = x->q + j0 * I;                                                                   \
        const float *d = x->d + j0 * nbs;                                                               \
        const i32x8 *c = x->c + j0 * nbs;                                                               \
        for (long o = o0; o < o1; o++) {                                                               \
            const u8 *wr = w + o * ldw;                                                                \
            const unsigned short *sr = sc + o * ng;                                                    \
            v8 acc[N];                                                                                 \
            for (int j = 0; j < N; j++) acc[j] = (v8){0};                                              \
            long b = 0;                                                                                \
            for (; b + 1 < nb; b += 2) {                                                               \
                if (b % 4 == 0) __builtin_prefetch(wr + ldw + b / 4 * CHUNK(XB));                      \
                const float s0 = half_float(sr[per == 1 ? b : b / per]);                               \
                const float s1 = half_float(sr[per == 1 ? b + 1 : (b + 1) / per]);                     \
                const b32 u0 = unpack_block(wr, b, XB), u1 = unpack_block(wr, b + 1, XB);              \
                for (int j = 0; j < N; j++) {                                                          \
                    const i32x8 l0 = dot_u8i8(c[j * nbs + b] * (1 << XB), u0, load32(q + j * I + b * 32)); \
                    const i32x8 l1 = dot_u8i8(c[j * nbs + b + 1] * (1 << XB), u1, load32(q + j * I + b * 32 + 32)); \
                    PAIR(acc[j], l0, d[j * nbs + b] * s0, l1, d[j * nbs + b + 1] * s1);                  \
                }                                                                                      \
            }                                                                                          \
            if (b < nb) {                                                                              \
                const float s0 = half_float(sr[b / per]);                                              \
                const b32 u0 = unpack_block(wr, b, XB);                                                \
                for (int j = 0; j < N; j++)                                                            \
                    acc[j] = fma8(to_float(dot_u8i8(c[j * nbs + b] * (1 << XB), u0, load32(q + j * I + b * 32))), \
                                  splat(d[j * nbs + b] * s0), acc[j]);                                  \
            }                                                                                          \
            for (int j = 0; j < N; j++) store(yf, yb, j * ldy + o, lanes8(acc[j]));                    \
        }                                                                                              \
    }

#else
/* each byte's high nibble: one GF(2) affine map (bits 4..7 to 0..3) where the CPU has GFNI, else a shift and a mask */
static inline __m512i high_nibbles(__m512i t, __m512i m15) {
#if defined(__GFNI__)
    (void)m15;
    return _mm512_gf2p8affine_epi64_epi8(t, _mm512_set1_epi64(0x1020408000000000ll), 0);
#else
    return _mm512_and_si512(_mm512_srli_epi16(t, 4), m15);
#endif
}
#ifndef Q4_SPF
#define Q4_SPF 512 /* the scales: bytes ahead of the current, one line every 32 blocks */
#endif
#ifndef Q4_PF
#define Q4_PF 4096 /* bytes ahead: a few rows (one row, 512 bytes at I = 1024, was measured too near) */
#endif
/* Q4X: four blocks a step (64 bytes of nibbles, block 4g + k's 16 bytes at 16 k). Their dwords transposed by one
   permute, so that dword 4i + k holds bytes 4i .. 4i + 3 of block k (low nibbles: elements 4i .. 4i + 3; high
   nibbles: 16 + 4i .. 16 + 4i + 3), the low and the high nibbles go through two vpdpbusd into the same 16 lanes,
   starting from the correction c: lane 4i + k = the exact sum over eight of block 4g + k's elements of (u - 8) q.
   Then per lane, in float32: acc += float(lane) * (d_b scale_b), the four scales and four d's broadcast to every
   128-bit lane. At the row's end its 16 lanes are added (_mm512_reduce_add_ps's fixed tree). Blocks past the row's
   end (nbs > nb) have q = c = 0 and scale 0 (masked loads: nothing past the row is read). The same for every x row
   whatever N, so a row's result does not depend on N. */
#define ROWS_Q4(N, NAME, XB)                                                                           \
    static void NAME##_##N(const struct qx *x, long j0, const u8 *w, long ldw, const unsigned short *sc, long G, \
                           float *yf, bf16 *yb, long ldy, long o0, long o1) {                          \
        const long I = x->I, nb = I / 32, ng = I / G, per = G / 32, nbs = x->nbs, full = nb / 4, ng4 = nbs / 4; \
        const i8 *q = x->q4 + j0 * nbs * 32;                                                           \
        const float *d = x->d + j0 * nbs;                                                              \
        const __m512i *c = (const __m512i *)(x->c + j0 * nbs);                                         \
        const __m512i perm = _mm512_set_epi32(15, 11, 7, 3, 14, 10, 6, 2, 13, 9, 5, 1, 12, 8, 4, 0);  \
        const __m512i m15 = _mm512_set1_epi8(15), m3 = _mm512_set1_epi8(3);                            \
        unsigned short hbuf[per == 1 ? 1 : nbs];                                                       \
        for (long o = o0; o < o1; o++) {                                                               \
            const u8 *wr = w + o * ldw;                                                                \
            const unsigned short *hs = sc + o * ng;                                                    \
            if (per > 1) {                                                                             \
                for (long b = 0; b < nb; b++) hbuf[b] = hs[b / per];                                   \
                for (long b = nb; b < nbs; b++) hbuf[b] = 0;                                           \
                hs = hbuf;                                                                             \
            }                                                                                          \
            __m512 acc[N];                                                                             \
            for (int j = 0; j < N; j++) acc[j] = _mm512_setzero_ps();                                  \
            for (long g = 0; g < ng4; g++) {                                                           \
                const long b = 4 * g;                                                                  \
                __m512i nib;                                                                           \
                __m128i h4;                                                                            \
                _mm_prefetch((const char *)(wr + Q4_PF + g * CHUNK(XB)), _MM_HINT_T0);                \
                if (Q4_SPF && g % 8 == 0) _mm_prefetch((const char *)(hs + b) + Q4_SPF, _MM_HINT_T0);                          \
                if (g < full || per > 1) {                                                             \
                    h4 = _mm_loadl_epi64((const __m128i *)(hs + b));                                   \
                } else {                                                                               \
                    h4 = _mm_maskz_loadu_epi16((__mmask8)((1u << (nb - b)) - 1), hs + b);              \
                }                                                                                      \
                if (g < full) {                                                                        \
                    nib = _mm512_loadu_si512(wr + g * CHUNK(XB));                                      \
                } else { /* int4 only: int6 rows are whole chunks */                                   \
                    nib = _mm512_maskz_loadu_epi8((__mmask64)((1ull << (16 * (nb - b))) - 1), wr + g * 64); \
                }                                                                                      \
                const __m512 s4 = _mm512_cvtph_ps(_mm256_broadcastq_epi64(h4));                        \
                const __m512i t = _mm512_permutexvar_epi32(perm, nib);                                 \
                __m512i lo = _mm512_and_si512(t, m15), hi = high_nibbles(t, m15);                      \
                if (XB) { /* int6: crumb byte k's bits 0-3 complete nibble byte k, its bits 4-7 byte k + 32 */ \
                    const __m256i cr = _mm256_loadu_si256((const __m256i *)(wr + g * CHUNK(XB) + 64));  \
                    const __m512i e = _mm512_permutexvar_epi32(                                        \
                        perm, _mm512_inserti64x4(_mm512_castsi256_si512(cr), _mm256_srli_epi16(cr, 4), 1)); \
                    lo = _mm512_or_si512(lo, _mm512_slli_epi16(_mm512_and_si512(e, m3), 4));            \
                    hi = _mm512_or_si512(hi, _mm512_slli_epi16(_mm512_and_si512(_mm512_srli_epi16(e, 2), m3), 4)); \
                }                                                                                      \
                for (int j = 0; j < N; j++) {                                                          \
                    const i8 *qj = q + j * nbs * 32 + g * 128;                                         \
                    __m512i l = _mm512_dpbusd_epi32(_mm512_slli_epi32(_mm512_load_si512(c + j * nbs / 2 + g), XB), lo, \
                                                    _mm512_load_si512(qj));                            \
                    l = _mm512_dpbusd_epi32(l, hi, _mm512_load_si512(qj + 64));                        \
                    const __m512 sd = _mm512_mul_ps(s4, _mm512_broadcast_f32x4(_mm_loadu_ps(d + j * nbs + b))); \
                    acc[j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(l), sd, acc[j]);                        \
                }                                                                                      \
            }                                                                                          \
            for (int j = 0; j < N; j++) store(yf, yb, j * ldy + o, _mm512_reduce_add_ps(acc[j]));      \
        }                                                                                              \
    }
#endif

ROWS_Q8(1) ROWS_Q8(2) ROWS_Q8(3) ROWS_Q8(4) ROWS_Q8(5) ROWS_Q8(6) ROWS_Q8(7) ROWS_Q8(8)
ROWS_Q4(1, q4, 0) ROWS_Q4(2, q4, 0) ROWS_Q4(3, q4, 0) ROWS_Q4(4, q4, 0)
ROWS_Q4(5, q4, 0) ROWS_Q4(6, q4, 0) ROWS_Q4(7, q4, 0) ROWS_Q4(8, q4, 0)
ROWS_Q4(1, q6, 2) ROWS_Q4(2, q6, 2) ROWS_Q4(3, q6, 2) ROWS_Q4(4, q6, 2)
ROWS_Q4(5, q6, 2) ROWS_Q4(6, q6, 2) ROWS_Q4(7, q6, 2) ROWS_Q4(8, q6, 2)

typedef void (*q8_fn)(const struct qx *, long, const i8 *, long, const float *, float *, bf16 *, long, long, long);
typedef void (*q4_fn)(const struct qx *, long, const u8 *, long, const unsigned short *, long, float *, bf16 *, long,
                      long, long);
static const q8_fn Q8_FOR[9] = {0, q8_1, q8_2, q8_3, q8_4, q8_5, q8_6, q8_7, q8_8};
static const q4_fn Q4_FOR[9] = {0, q4_1, q4_2, q4_3, q4_4, q4_5, q4_6, q4_7, q4_8};
static const q4_fn Q6_FOR[9] = {0, q6_1, q6_2, q6_3, q6_4, q6_5, q6_6, q6_7, q6_8};

enum { QBLOCK = 32 }; /* past 8 rows: 32 weight rows (<= 32 KB of int8) stay in cache while x goes 8 rows at a time */

int quant_format_ok(int fmt, long group, long I) {
    if (I % 32) return 0;
    if (fmt == QUANT_INT8) return 1;
    return (fmt == QUANT_INT4 || (fmt == QUANT_INT6 && I % 128 == 0)) && group >= 32 && group % 32 == 0 && I % group == 0;
}

void share_q(const struct qx *x, long n, const void *w, const void *scale, int fmt, long group, float *yf, bf16 *yb,
             long ldy, long O, int t, int T) {
    long o0, o1;
    if (!thread_rows(O, t, T, &o0, &o1) || n == 0) return;
    const long I = x->I, step = n <= 8 ? o1 - o0 : QBLOCK;
    for (long b0 = o0; b0 < o1; b0 += step) {
        const long b1 = b0 + step < o1 ? b0 + step : o1;
        for (long j0 = 0; j0 < n; j0 += 8) {
            const long m = n - j0 < 8 ? n - j0 : 8;
            float *f = yf ? yf + j0 * ldy : 0;
            bf16 *h = yb ? yb + j0 * ldy : 0;
            if (fmt == QUANT_INT8)
                Q8_FOR[m](x, j0, (const i8 *)w, I, (const float *)scale, f, h, ldy, b0, b1);
            else if (fmt == QUANT_INT4)
                Q4_FOR[m](x, j0, (const u8 *)w, I / 2, (const unsigned short *)scale, group, f, h, ldy, b0, b1);
            else
                Q6_FOR[m](x, j0, (const u8 *)w, I / 4 * 3, (const unsigned short *)scale, group, f, h, ldy, b0, b1);
        }
    }
}

/* The public calls: x quantized by the threads (a row each in turn), then each thread's share of w's rows. */
#define LINEAR_Q(NAME, T, QUANTIZE)                                                                    \
    int NAME(const T *x, long ldx, const void *w, const void *scale, int fmt, long group, T *y, long ldy, long n, \
             long O, long I, int threads) {                                                            \
        if (!quant_format_ok(fmt, group, I)) return -4;                                                \
        void *mem = malloc(qx_bytes(n, I));                                                            \
        if (!mem) return -2;                                                                           \
        struct qx p = qx_at(mem, n, I);                                                                \
        _Pragma("omp parallel num_threads(threads)")                                                   \
        {                                                                                              \
            const int t = omp_get_thread_num(), nt = omp_get_num_threads();                            \
            QUANTIZE(x, ldx, n, &p, t, nt);                                                            \
            _Pragma("omp barrier")                                                                     \
            share_q(&p, n, w, scale, fmt, group, OUT_F_##T(y), OUT_B_##T(y), ldy, O, t, nt);           \
        }                                                                                              \
        free(mem);                                                                                     \
        return 0;                                                                                      \
    }
#define OUT_F_float(y) (y)
#define OUT_B_float(y) ((bf16 *)0)
#define OUT_F_bf16(y) ((float *)0)
#define OUT_B_bf16(y) (y)

LINEAR_Q(linear_q, float, quantize_rows)
LINEAR_Q(linear_q_bf16, bf16, quantize_rows_b)
