#include "common.h"

/* RMSNorm of n rows of D, one thread: y = x / sqrt(mean(x^2) + eps) * w, computed in float32 (bf16 rows widened,
   the result rounded once). torch's rms_norm on a CPU is half a dozen operations, and a decode
   step makes two per layer; this is one call. The sum of squares
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