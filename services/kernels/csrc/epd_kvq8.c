/* The int8 KV cache of the "cpu" backend (services/kernels/kv_quant.py; see epd_cpu.c for
 * how the library is built).
 *
 * A cache row, one token's vector of one KV head, is d int8 codes followed by the four
 * bytes of its fp32 scale: value j = codes[j] * scale. epd_kv_quantize writes rows with
 * the operations of kv_quant.quantize, in the same order (so the native step and the
 * torch path store the same bytes); epd_decode_attention_q8 is epd_decode_attention's
 * contract over such a cache, for head sizes divisible by 8.
 *
 * Each K or V row is widened to fp32 once (AVX2: eight codes an instruction) and read
 * from L1 by every query head of its GQA group; a key's scale multiplies its finished dot
 * product, a value's scale its softmax weight. A row costs d + 4 bytes from memory where
 * the fp32 cache costs 4d: at long contexts the int8 cache is faster, at short ones even.
 * One query row at a time, each of its sums in a fixed order: a row's result does not
 * depend on its batch. */
#include "epd_common.h"
#if defined(__AVX2__)
#include <immintrin.h>
#endif

#define ROW(d) ((d) + 4) /* bytes of a cache row */

/* codes[0:d] as floats (d % 8 == 0): each K or V row is widened once, then read by every
 * query head of its group from L1. */
static inline void widen(float *out, const int8_t *codes, int64_t d) {
    for (int64_t j = 0; j < d; j += 8) {
#if defined(__AVX2__)
        const __m128i b = _mm_loadl_epi64((const __m128i *)(codes + j));
        _mm256_storeu_ps(out + j, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b)));
#else
        for (int64_t i = j; i < j + 8; i++) out[i] = (float)codes[i];
#endif
    }
}

static inline float row_scale(const int8_t *row, int64_t d) {
    float s;
    memcpy(&s, row + d, sizeof s);
    return s;
}

/* n vectors of d floats -> n cache rows (d + 4 bytes each, written to dst). */
void epd_kv_quantize(int8_t *dst, const float *x, int64_t n, int64_t d) {
    for (int64_t i = 0; i < n; i++) {
        const float *xi = x + i * d;
        int8_t *ri = dst + i * ROW(d);
        float amax = 0.f;
        for (int64_t j = 0; j < d; j++) amax = fabsf(xi[j]) > amax ? fabsf(xi[j]) : amax;
        const float scale = amax / 127.f, div = scale > 0.f ? scale : 1.f;
        for (int64_t j = 0; j < d; j++) {
            const float c = rintf(xi[j] / div);
            ri[j] = (int8_t)(c > 127.f ? 127.f : c < -127.f ? -127.f : c);
        }
        memcpy(ri + d, &scale, sizeof scale);
    }
}

/* <q, x> over d features (d % 8 == 0): two chains of eight lanes, then their lanes. */
static inline float dot8(const float *q, const float *x, int64_t d) {
    v8 a0 = {0}, a1 = {0};
    int64_t j = 0;
    for (; j + 16 <= d; j += 16) {
        a0 = fma8(load8(q + j), load8(x + j), a0);
        a1 = fma8(load8(q + j + 8), load8(x + j + 8), a1);
    }
    if (j < d) a0 = fma8(load8(q + j), load8(x + j), a0);
    float lanes[8];
    const v8 a = a0 + a1;
    memcpy(lanes, &a, sizeof lanes);
    return tree_sum(lanes, 8);
}

/* o[0:d] += w * x[0:d] */
static inline void axpy8(float *o, float w, const float *x, int64_t d) {
    const v8 wv = splat8(w);
    for (int64_t j = 0; j < d; j += 8) {
        const v8 r = fma8(wv, load8(x + j), load8(o + j));
        memcpy(o + j, &r, sizeof r);
    }
}

/* epd_decode_attention over an int8 cache [num_blocks, bs, hkv, d + 4] bytes (d % 8 == 0):
 * query i of this call is row rows[i] of q/out ([T, hq, d]) and attends to positions
 * 0 .. lens[i] - 1 of the sequence whose table is tables + seqs[i] * table_stride. Pass 1
 * scores every head against each key row, widened once for its group; the softmax is
 * epd_decode_attention's; pass 2 sums the V rows, widened once each, weighted by the
 * softmax times the row's scale. Returns 0, or -1 if scratch memory could not be
 * allocated. */
int epd_decode_attention_q8(float *out, const float *q, const int8_t *kc, const int8_t *vc,
                            const int32_t *tables, int64_t table_stride, const int32_t *lens,
                            const int64_t *rows, const int64_t *seqs, int64_t n, int64_t hq,
                            int64_t hkv, int64_t d, int64_t bs, float scale) {
    int64_t maxlen = 1;
    for (int64_t i = 0; i < n; i++)
        if (lens[i] > maxlen) maxlen = lens[i];
    float *scores = malloc(sizeof(float) * (size_t)(hq * maxlen + d));
    int64_t *offs = malloc(sizeof(int64_t) * (size_t)maxlen);
    if (!scores || !offs) {
        free(scores);
        free(offs);
        return -1;
    }
    float *row = scores + hq * maxlen; /* one K or V row, widened */
    const int64_t group = hq / hkv, tok = hkv * ROW(d);
    for (int64_t i = 0; i < n; i++) {
        const int32_t *table = tables + seqs[i] * table_stride;
        const int64_t len = lens[i];
        const float *qr = q + rows[i] * hq * d;
        float *o = out + rows[i] * hq * d;
        memset(o, 0, sizeof(float) * (size_t)(hq * d));
        if (len < 1) continue; /* attends to nothing: no row the backend plans */
        for (int64_t t = 0; t < len; t++) offs[t] = ((int64_t)table[t / bs] * bs + t % bs) * tok;
        for (int64_t t = 0; t < len; t++)
            for (int64_t kh = 0; kh < hkv; kh++) {
                const int8_t *k = kc + offs[t] + kh * ROW(d);
                const float ks = row_scale(k, d) * scale;
                widen(row, k, d);
                for (int64_t h = kh * group; h < (kh + 1) * group; h++)
                    scores[h * len + t] = dot8(qr + h * d, row, d) * ks;
            }
        for (int64_t h = 0; h < hq; h++) epd_softmax(scores + h * len, len);
        for (int64_t t = 0; t < len; t++)
            for (int64_t kh = 0; kh < hkv; kh++) {
                const int8_t *v = vc + offs[t] + kh * ROW(d);
                const float vs = row_scale(v, d);
                widen(row, v, d);
                for (int64_t h = kh * group; h < (kh + 1) * group; h++)
                    axpy8(o + h * d, scores[h * len + t] * vs, row, d);
            }
    }
    free(offs);
    free(scores);
    return 0;
}
