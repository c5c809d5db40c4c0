/* The C kernels' public interface: every function the library exports and every struct it shares with Python.

   The one declaration both sides follow: each .c file includes it, so a definition that disagrees with it does not
   compile, and cpu_kernel.py derives its ctypes bindings from the prototypes below and checks kernel_decode.py's
   Structures against the structs, refusing a library whose moeserve_kernel_abi() is not the MOESERVE_KERNEL_ABI it
   was written for. Keep it plain for that parser: one prototype per declaration, the types it knows (float, int,
   long, void, bf16, the structs below; any pointer to them), no macros in prototypes.

   Shapes are row-major and strides counted in elements; "bf16" is bfloat16's bits. A float32 op and its bf16 twin
   (suffix _bf16) compute the same sums in the same order, in float32, rounding the bf16 results once. */
#ifndef MOESERVE_KERNELS_H
#define MOESERVE_KERNELS_H

#define MOESERVE_KERNEL_ABI 4 /* raise on any change to a prototype or struct below */

typedef unsigned short bf16;

int moeserve_kernel_abi(void);
int bf16_native(void); /* 1: bf16 products by AVX512-BF16's dot products; 0: widened to float32 */

/* gemm.c: y [n, O] = x [n, I] w [O, I]^T, rows at strides ldx, ldw, ldy. */
void linear_nt(const float *x, long ldx, const float *w, long ldw, float *y, long ldy, long n, long O, long I,
               int threads);
void linear_nt_bf16(const bf16 *x, long ldx, const bf16 *w, long ldw, bf16 *y, long ldy, long n, long O, long I,
                    int threads);

/* quant.c: y [n, O] = x [n, I] w^T on a quantized weight (runtime/quant.py's formats): fmt QUANT_INT8, w int8
   [O, I] and scale float32 [O]; or QUANT_INT4, w uint8 [O, I/2] (nibbles) and scale float16 [O, I/group] (group a
   multiple of 32 dividing I); or QUANT_INT6, w uint8 [O, 3I/4] (96 bytes per 128 elements, I a multiple of 128)
   and scale as int4's. I a multiple of 32. The activations are quantized to int8 per 32-element block
   (quant.c's comment has the arithmetic); y in x's dtype. Returns 0; -2 without memory; -4 (nothing written) for a
   format, group or width it does not take. */
#define QUANT_FLOAT 0
#define QUANT_INT8 1
#define QUANT_INT4 2
#define QUANT_INT6 3
int linear_q(const float *x, long ldx, const void *w, const void *scale, int fmt, long group, float *y, long ldy,
             long n, long O, long I, int threads);
int linear_q_bf16(const bf16 *x, long ldx, const void *w, const void *scale, int fmt, long group, bf16 *y, long ldy,
                  long n, long O, long I, int threads);

/* experts.c: a MoE layer's experts. experts_ffn: rows sorted by expert, counts[e] for expert e; moe_ffn: routed
   tokens (ids, gates [n_tok, K]), returning -1 for an id outside [0, E), -2 without memory. */
void experts_ffn(const float *x, const long *counts, const float *w1, const float *w3, const float *w2, long s1,
                 long s3, long s2, float *h, float *y, long E, long D, long F, int threads);
void experts_ffn_bf16(const bf16 *x, const long *counts, const bf16 *w1, const bf16 *w3, const bf16 *w2, long s1,
                      long s3, long s2, float *h, bf16 *hb, bf16 *y, long E, long D, long F, int threads);
int moe_ffn(const float *x, const long *ids, const float *gates, long n_tok, long K, const float *w1, const float *w3,
            const float *w2, long s1, long s3, long s2, float *out, long E, long D, long F, int threads);
int moe_ffn_bf16(const bf16 *x, const long *ids, const bf16 *gates, long n_tok, long K, const bf16 *w1,
                 const bf16 *w3, const bf16 *w2, long s1, long s3, long s2, bf16 *out, long E, long D, long F,
                 int threads);
/* moe_ffn on quantized stacked experts (linear_q's fmt and group): expert e's weights at w + e * s bytes, its
   scales at c + e * t elements (float32 for int8, float16 for int4); w3 and c3 NULL for gelu. D and F multiples of
   32 (and of an int4 group). Returns moe_ffn's codes, and -4 for a format or group the widths do not take. */
int moe_ffn_q(const float *x, const long *ids, const float *gates, long n_tok, long K, int fmt, long group,
              const void *w1, const void *w3, const void *w2, const void *c1, const void *c3, const void *c2, long s1,
              long s3, long s2, long t1, long t3, long t2, float *out, long E, long D, long F, int threads);
int moe_ffn_q_bf16(const bf16 *x, const long *ids, const bf16 *gates, long n_tok, long K, int fmt, long group,
                   const void *w1, const void *w3, const void *w2, const void *c1, const void *c3, const void *c2,
                   long s1, long s3, long s2, long t1, long t3, long t2, bf16 *out, long E, long D, long F,
                   int threads);

/* norm.c: RMSNorm of n rows of D. */
void rms_norm(const float *x, const float *w, float *y, long n, long D, float eps);
void rms_norm_bf16(const bf16 *x, const bf16 *w, bf16 *y, long n, long D, float eps);

/* attention.c: one decode query per row over its slot of the KV cache [slots, G, max_len, Dh]; kn, vn (this step's
   keys and values) and cs, sn (RoPE rows) may be NULL. */
void attend_decode(const float *q, const float *kn, const float *vn, const float *cs, const float *sn, float *k,
                   float *v, float *y, const long *slots, const long *lo, const long *hi, long B, long H, long G,
                   long Dh, long max_len, float scale, int threads);
void attend_decode_bf16(const bf16 *q, const bf16 *kn, const bf16 *vn, const bf16 *cs, const bf16 *sn, bf16 *k,
                        bf16 *v, bf16 *y, const long *slots, const long *lo, const long *hi, long B, long H, long G,
                        long Dh, long max_len, float scale, int threads);

/* router.c: a MoE router. gate: 0 softmax, 1 sigmoid (kernel_decode.GATES). */
struct router {
    const void *w;    /* [P, D] the gate (P = E), or X-MoE's projection (P = its routing dim R) */
    const float *emb; /* [E, R] X-MoE's expert embeddings as unit rows; NULL: the scores are w x itself */
    long P, E, K;
    float tau; /* the scores are divided by it (1 but for X-MoE) */
    int gate, renormalize;
};

int route_tokens(const float *x, long n, long D, const struct router *r, long *ids, float *gates, int threads);
int route_tokens_bf16(const bf16 *x, long n, long D, const struct router *r, long *ids, bf16 *gates, int threads);

/* step.c: a whole decode step. Every float weight in the float32 or bf16 of the call; the linear maps' weights may be
   quantized instead (fmt), the norms', routers' and the tables' not. */
struct layer {
    const void *n1, *wq, *wk, *wv, *wo, *n2; /* the two norms' weights, attention's [out, in] weights */
    float eps1, eps2;
    struct router router;
    const void *w1, *w3, *w2; /* the stacked experts, expert e at w + e * s (moe_ffn's) */
    long s1, s3, s2;
    /* fmt QUANT_INT8 or QUANT_INT4 (int4's group in group): wq .. wo and w1, w3, w2 are quantized (linear_q's and
       moe_ffn_q's layouts; s1, s3, s2 in bytes) and these are their scales, expert e's at c + e * t elements.
       QUANT_FLOAT (0, as a struct filled only up to here is): the float weights above, these unused. */
    const void *cq, *ck, *cv, *co, *c1, *c3, *c2;
    long t1, t3, t2;
    int fmt;
    long group;
    /* ABI 3: in a quantized layer (fmt set), wq, wk, wv and wo's own formats and groups: an int4 layer may keep some
       of them at int8 (runtime/quant.py's QuantSpec.int8); the experts' are fmt and group above */
    int fq, fk, fv, fo;
    long gq, gk, gv, go;
    /* ABI 4: QK-norm (Qwen3, OLMoE), RMSNorm of q and k before RoPE with weights qn and kn and epsilon qk_eps: qk 1
       over each head's Dh values, 2 over a row's whole q (H Dh) and k (G Dh); 0 (as a struct filled only up to
       here is): none */
    const void *qn, *kn;
    float qk_eps;
    int qk;
};

struct model {
    long L, D, H, G, Dh, F, V;
    const struct layer *layers;
    const void *norm, *head; /* the final RMSNorm's weight and the LM head [V, D] */
    float eps;
    const void *emb, *cos, *sin; /* the token embeddings [n_emb, D], the RoPE tables [n_pos, Dh] */
    long n_emb, n_pos, window;
    const void *head_scale; /* head_fmt QUANT_INT8 or QUANT_INT4: head is quantized, these its scales and group */
    int head_fmt;
    long head_group;
};

int decode_step(const struct model *m, const long *tokens, const long *slots, const long *pos, long B,
                float *const *kc, float *const *vc, long n_slots, long max_len, float scale, float *logits, long *ids,
                float *gates, long *counts, int threads);
int decode_step_bf16(const struct model *m, const long *tokens, const long *slots, const long *pos, long B,
                     bf16 *const *kc, bf16 *const *vc, long n_slots, long max_len, float scale, bf16 *logits,
                     long *ids, bf16 *gates, long *counts, int threads);

#endif
