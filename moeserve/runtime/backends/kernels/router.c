#include "common.h"

/* A router's choice from a token's E scores, in float32: softmax (Switch, Mixtral; renormalized over the K chosen
   where the config says) or sigmoid, of w x, or X-MoE's of the cosines of w x with the expert embeddings over tau
   (paper 000, eq. 6-7). The K largest, a tie to the lower id, and their gates, as routing.py computes them in
   torch up to the last bits of exp and of the sums (torch's vectorised exp is not libm's): the torch routers are
   the reference it is tested against. On the kernel this routes every token count, prefill and decode alike, so
   that a prompt's tokens route the same whichever path a step takes. An id is always in [0, E), NaN or not. */
enum { GATE_SOFTMAX = 0, GATE_SIGMOID = 1 }; /* struct router's gate */

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