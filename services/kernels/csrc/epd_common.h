/* Helpers shared by the native CPU kernels (epd_cpu.c, epd_attention.c): fp32, written so
 * the compiler vectorizes them without -ffast-math. */
#ifndef EPD_COMMON_H
#define EPD_COMMON_H

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define VW 8 /* partial sums per reduction (8 beat 4 and 16 on the attention here) */

/* Sum of VW partial sums as a tree (vectorizes; a serial chain would cost ~VW adds of
 * latency for every short dot product). */
static inline float hsum(float *acc) {
    for (int w = VW / 2; w > 0; w /= 2)
        for (int j = 0; j < w; j++) acc[j] += acc[j + w];
    return acc[0];
}

static inline float dot(const float *a, const float *b, int64_t n) {
    float acc[VW] = {0};
    int64_t i = 0;
    for (; i + VW <= n; i += VW)
        for (int j = 0; j < VW; j++) acc[j] += a[i + j] * b[i + j];
    float s = 0.f;
    for (; i < n; i++) s += a[i] * b[i];
    return s + hsum(acc);
}

/* e^x for x <= 0 ... 88, branch-free so loops over it vectorize (libm's expf does not
 * without -ffast-math). x = n ln2 + r, |r| <= ln2/2; e^r by a degree-6 Taylor polynomial
 * (relative error < 2e-7, about one float ulp); 2^n built in the exponent bits. */
static inline float exp_approx(float x) {
    x = x < -87.f ? -87.f : (x > 88.f ? 88.f : x);
    const float magic = 12582912.f; /* 1.5 * 2^23: adding it rounds to an integer */
    const float n = (x * 1.44269504088896341f + magic) - magic;
    const float r = (x - n * 0.693145751953125f) - n * 1.428606765330187e-06f;
    float p = 1.f / 720.f;
    p = p * r + 1.f / 120.f;
    p = p * r + 1.f / 24.f;
    p = p * r + 1.f / 6.f;
    p = p * r + 0.5f;
    p = p * r + 1.f;
    p = p * r + 1.f;
    union { float f; int32_t i; } two_n = {.i = ((int32_t)n + 127) << 23};
    return p * two_n.f;
}

static inline void axpy(float *y, float a, const float *x, int64_t n) {
    for (int64_t i = 0; i < n; i++) y[i] += a * x[i];
}

#endif
