#include "common.h"

/* Attention of one decode query per row over its slot of the KV cache, in place: row b's query heads
   q [B, H, Dh] against keys and values [slots, G, max_len, Dh] at slot slots[b], positions lo[b] .. hi[b] - 1
   (its causal window), query head h reading kv head h / (H / G). One pass with a running maximum (the
   softmax's rescaling as flash attention does it), scores and sums in float32. SDPA on a CPU needs the rows'
   slots gathered out of the cache and a mask built; this reads the cache where it lies. Each (row, head) is one thread's work, the same operations whatever the batch.

   With kn and vn (this step's keys and values [B, G, Dh]), they are first written at position hi[b] - 1 of
   each row's slot; with cs and sn (the rows' RoPE tables [B, Dh]), q and kn are rotated first (rotate-half:
   x cos + [-x2, x1] sin), rounded where torch's apply_rope rounds (each product and the sum, in T). That was a
   dozen torch operations and two indexed writes per layer around this call. */
#define ATTEND(NAME, T, LOAD8, LOAD1, STORE1, ROUND)                                                   \
    /* the work of the threads of an enclosing parallel region (its loops are orphaned omp for's), or of one */ \
    void NAME##_rows(const T *q, const T *kn, const T *vn, const T *cs, const T *sn, T *k, T *v, T *y,           \
                     const long *slots, const long *lo, const long *hi, long B, long H, long G, long Dh,         \
                     long max_len, float scale) {                                                               \
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