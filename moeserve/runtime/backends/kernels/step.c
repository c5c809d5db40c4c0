/* decode_step: a whole decode step composed of the other files' ops (rms_norm, linear_nt's threads' shares,
   attend_decode's rows, route_tokens, moe_ffn), the only fused decode path: Python builds its structs once and
   makes one call a token. */
#include "common.h"

/* A decode layer's attention half, for B rows of one token each: xn = RMSNorm(x), q k v = xn W^T, QK-norm where
   the layer has it, RoPE, the
   cache write and attention as attend_decode, h = x + attention Wo^T, hn = RMSNorm(h) (the MoE half's input).
   The same operations as rms_norm, linear_nt and attend_decode called one by one, so the same numbers, in one
   parallel region: a fork and join of the threads, not eight. The weights are nn.Linear's [out, in] with
   contiguous rows; scratch holds B * (2D + 2(H + G)Dh) elements. */
static void gemv_f32(const float *x, const float *w, float *y, long n, long O, long I, int t, int T) {
    share(x, I, w, I, y, O, n, O, I, t, T);
}
static void gemv_bf16(const bf16 *x, const bf16 *w, bf16 *y, long n, long O, long I, int t, int T) {
    share_b(x, I, w, I, 0, y, O, n, O, I, t, T);
}
static inline float add_f32(float a, float b) { return a + b; }
static inline bf16 add_bf16(bf16 a, bf16 b) { return float_bf16(bf16_float(a) + bf16_float(b)); } /* torch's bf16 + */

static void gemv_q_f32(const struct qx *x, const void *w, const void *c, int fmt, long group, float *y, long n, long O,
                       int t, int T) {
    share_q(x, n, w, c, fmt, group, y, 0, O, O, t, T);
}
static void gemv_q_bf16(const struct qx *x, const void *w, const void *c, int fmt, long group, bf16 *y, long n, long O,
                        int t, int T) {
    share_q(x, n, w, c, fmt, group, 0, y, O, O, t, T);
}

/* ly->fmt QUANT_INT8 or QUANT_INT4: wq .. wo are quantized (scales cq .. co; formats fq .. fo, which may differ), each
   GEMM's input quantized first by one thread (pa: B rows of D, pb: B rows of H Dh), linear_q's arithmetic: the
   activations' blocks are the same whatever the weight's format. Else the float GEMVs above. */
#define ATTENTION_HALF(NAME, T, GEMV, GEMV_Q, QUANTIZE, RMS, ADD, ATTEND_ROWS)                         \
    static void NAME(const T *x, const struct layer *ly, const T *cs, const T *sn, T *kc, T *vc, const long *slots, \
                     const long *lo, const long *hi, long B, long D, long H, long G, long Dh, long max_len,    \
                     float scale, T *scratch, struct qx *pa, struct qx *pb, T *h, T *hn, int threads) {         \
        T *xn = scratch, *q = xn + B * D, *kn = q + B * H * Dh, *vn = kn + B * G * Dh, *att = vn + B * G * Dh; \
        T *ao = att + B * H * Dh;                                                                      \
        const int fmt = ly->fmt;                                                                       \
        _Pragma("omp parallel num_threads(threads)")                                                   \
        {                                                                                              \
            const int t = omp_get_thread_num(), nt = omp_get_num_threads();                            \
            _Pragma("omp single")                                                                      \
            {                                                                                          \
                RMS(x, (const T *)ly->n1, xn, B, D, ly->eps1);                                         \
                if (fmt) QUANTIZE(xn, D, B, pa, 0, 1);                                                 \
            }                                                                                          \
            if (fmt) {                                                                                 \
                GEMV_Q(pa, ly->wq, ly->cq, ly->fq, ly->gq, q, B, H * Dh, t, nt);                       \
                GEMV_Q(pa, ly->wk, ly->ck, ly->fk, ly->gk, kn, B, G * Dh, t, nt);                      \
                GEMV_Q(pa, ly->wv, ly->cv, ly->fv, ly->gv, vn, B, G * Dh, t, nt);                      \
            } else {                                                                                   \
                GEMV(xn, (const T *)ly->wq, q, B, H * Dh, D, t, nt);                                   \
                GEMV(xn, (const T *)ly->wk, kn, B, G * Dh, D, t, nt);                                  \
                GEMV(xn, (const T *)ly->wv, vn, B, G * Dh, D, t, nt);                                  \
            }                                                                                          \
            _Pragma("omp barrier")                                                                     \
            if (ly->qk) {                                                                              \
                _Pragma("omp single") /* in place: RMS reads a row whole before it writes it */       \
                {                                                                                      \
                    const long wq_ = ly->qk == 1 ? Dh : H * Dh, wk_ = ly->qk == 1 ? Dh : G * Dh;       \
                    RMS(q, (const T *)ly->qn, q, B * H * Dh / wq_, wq_, ly->qk_eps);                   \
                    RMS(kn, (const T *)ly->kn, kn, B * G * Dh / wk_, wk_, ly->qk_eps);                 \
                }                                                                                      \
            }                                                                                          \
            ATTEND_ROWS(q, kn, vn, cs, sn, kc, vc, att, slots, lo, hi, B, H, G, Dh, max_len, scale); /* a barrier */ \
            if (fmt) {                                                                                 \
                _Pragma("omp single")                                                                  \
                QUANTIZE(att, H * Dh, B, pb, 0, 1);                                                    \
                GEMV_Q(pb, ly->wo, ly->co, ly->fo, ly->go, ao, B, D, t, nt);                           \
            } else {                                                                                   \
                GEMV(att, (const T *)ly->wo, ao, B, D, H * Dh, t, nt);                                 \
            }                                                                                          \
            _Pragma("omp barrier")                                                                     \
            _Pragma("omp single")                                                                      \
            {                                                                                          \
                for (long i = 0; i < B * D; i++) h[i] = ADD(x[i], ao[i]);                              \
                RMS(h, (const T *)ly->n2, hn, B, D, ly->eps2);                                         \
            }                                                                                          \
        }                                                                                              \
    }

ATTENTION_HALF(attention_half, float, gemv_f32, gemv_q_f32, quantize_rows, rms_norm, add_f32, attend_decode_rows)
ATTENTION_HALF(attention_half_bf16, bf16, gemv_bf16, gemv_q_bf16, quantize_rows_b, rms_norm_bf16, add_bf16,
               attend_decode_bf16_rows)

/* -4 where a quantized layer's or head's format does not suit its widths (nothing written) */
static int formats_ok(const struct model *m) {
    for (long l = 0; l < m->L; l++) {
        const struct layer *ly = m->layers + l;
        if (ly->fmt && !(quant_format_ok(ly->fmt, ly->group, m->D) && quant_format_ok(ly->fmt, ly->group, m->F)
                         && quant_format_ok(ly->fq, ly->gq, m->D) && quant_format_ok(ly->fk, ly->gk, m->D)
                         && quant_format_ok(ly->fv, ly->gv, m->D) && quant_format_ok(ly->fo, ly->go, m->H * m->Dh)))
            return 0;
    }
    return !m->head_fmt || quant_format_ok(m->head_fmt, m->head_group, m->D);
}

/* A whole decode step of B rows (one token each) through every layer and the LM head, in one call: the rows'
   embeddings and RoPE angles looked up, then per layer its attention half (attention_half), route_tokens and
   moe_ffn, and the residual sum; then the final RMSNorm and the head. The same calls Transformer.forward makes
   one by one on the kernel, so the same numbers; what goes is the Python between them, which ran on caches a
   weight-streaming step had just left cold (figures in docs/design-notes.md, "The CPU kernel as ops"). Each
   layer's weights are where the model holds them (struct layer), the tables too (struct model); the cache is
   the call's. Row b is token tokens[b] at position pos[b] of slot slots[b], seeing positions
   max(0, pos + 1 - window) .. pos (window 0: all). Out: logits [B, V], each layer's ids and gates
   [L, B, K] and expert counts [L, E]. Returns 0; -2 where there was no memory for the scratch; -3, before
   anything is written, where a token, slot or position is out of range; -4, likewise, where a quantized weight's
   format does not suit its widths. Quantized weights (struct layer's fmt, struct model's head_fmt) go through
   linear_q's and moe_ffn_q's arithmetic, the float ones as before. */
#define DECODE_STEP(NAME, T, BLOCK, ROUTE_ROWS, MOE, MOE_Q, ADD, RMS, LINEAR, LINEAR_Q)                                 \
    int NAME(const struct model *m, const long *tokens, const long *slots, const long *pos, long B,    \
             T *const *kc, T *const *vc, long n_slots, long max_len, float scale, T *logits, long *ids, \
             T *gates, long *counts, int threads) {                                                    \
        const long D = m->D, H = m->H, G = m->G, Dh = m->Dh;                                           \
        for (long b = 0; b < B; b++)                                                                   \
            if (tokens[b] < 0 || tokens[b] >= m->n_emb || slots[b] < 0 || slots[b] >= n_slots ||       \
                pos[b] < 0 || pos[b] >= max_len || pos[b] >= m->n_pos)                                 \
                return -3;                                                                             \
        if (!formats_ok(m)) return -4;                                                                 \
        /* the bounds, 5 rows of D (the input, 4 of the layers'), the RoPE rows, attention_half's scratch */ \
        long *buf = malloc(2 * B * sizeof(long) + (B * (7 * D + 2 * Dh + 2 * (H + G) * Dh) + 1) * sizeof(T)); \
        void *qm = malloc(qx_bytes(B, D) + qx_bytes(B, H * Dh));                                       \
        if (!buf || !qm) {                                                                             \
            free(buf), free(qm);                                                                       \
            return -2;                                                                                 \
        }                                                                                              \
        struct qx pa = qx_at(qm, B, D), pb = qx_at((char *)qm + qx_bytes(B, D), B, H * Dh);            \
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
            BLOCK(cur, ly, cs, sn, kc[l], vc[l], slots, lo, hi, B, D, H, G, Dh, max_len, scale, scratch, &pa, &pb, h, \
                  hn, threads);                                                                        \
            status = ROUTE_ROWS(hn, B, D, &ly->router, il, gl, threads);                               \
            if (status == 0 && ly->fmt)                                                                \
                status = MOE_Q(hn, il, gl, B, K, ly->fmt, ly->group, ly->w1, ly->w3, ly->w2, ly->c1, ly->c3, ly->c2, \
                               ly->s1, ly->s3, ly->s2, ly->t1, ly->t3, ly->t2, y, E, D, m->F, threads);   \
            else if (status == 0)                                                                      \
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
            if (m->head_fmt)                                                                           \
                status = LINEAR_Q(hn, D, m->head, m->head_scale, m->head_fmt, m->head_group, logits, m->V, B, m->V, \
                                  D, threads);                                                         \
            else                                                                                       \
                LINEAR(hn, D, m->head, D, logits, m->V, B, m->V, D, threads);                          \
        }                                                                                              \
        free(buf), free(qm);                                                                           \
        return status;                                                                                 \
    }

DECODE_STEP(decode_step, float, attention_half, route_tokens, moe_ffn, moe_ffn_q, add_f32, rms_norm, linear_nt,
            linear_q)
DECODE_STEP(decode_step_bf16, bf16, attention_half_bf16, route_tokens_bf16, moe_ffn_bf16, moe_ffn_q_bf16, add_bf16,
            rms_norm_bf16, linear_nt_bf16, linear_q_bf16)