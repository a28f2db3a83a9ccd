/* A whole decode step of a Llama-family decoder stack in one call (the "cpu" backend's
 * decode_stack; see epd_cpu.c for how the library is built).
 *
 * Batch-1 decode reads every weight once per token, so it is bound by memory bandwidth;
 * issued op by op from Python, the ~10 ops of each layer cost about as much again in
 * dispatch. This file chains the same kernels (epd_gemv_t, epd_rms_norm, epd_rotary,
 * epd_decode_attention, epd_silu_mul) in the same order and on the same buffers' layouts
 * as services/models/llama.py does through the backend, so its results are bitwise those of
 * the op-by-op path at one thread.
 */
#include "epd_common.h"

/* Per-layer pointers, in this order (0 where a model has no such tensor). Weights are
 * W^T row-major ([in, out]), the layout models keep on CPU. */
enum {
    L_IN_NORM, L_QKV_WT, L_QKV_B, L_Q_NORM, L_K_NORM, L_O_WT, L_O_B, L_POST_NORM,
    L_GU_WT, L_GU_B, L_DOWN_WT, L_DOWN_B, L_K_CACHE, L_V_CACHE, L_NPTR
};

/* Sizes, in this order. */
enum {
    D_ROWS, D_HIDDEN, D_HQ, D_HKV, D_HEAD, D_INTER, D_ROT, D_MAX_POS, D_NUM_BLOCKS,
    D_BLOCK, D_TABLE_STRIDE, D_TABLE_WIDTH, D_LAYERS, D_NDIMS
};

#define P(l, i) ((const float *)(intptr_t)(l)[i])

/* The step's indices are read as raw offsets below: check them all first. */
static int check_step(const int64_t *dm, const int64_t *pos, const int64_t *slots,
                      const int32_t *tables, const int32_t *lens) {
    const int64_t bs = dm[D_BLOCK], nb = dm[D_NUM_BLOCKS];
    for (int64_t i = 0; i < dm[D_ROWS]; i++) {
        if (pos[i] < 0 || pos[i] >= dm[D_MAX_POS]) return -2;
        if (slots[i] >= nb * bs) return -3;
        if (lens[i] < 1 || lens[i] > dm[D_TABLE_WIDTH] * bs) return -4;
        const int32_t *t = tables + i * dm[D_TABLE_STRIDE];
        for (int64_t b = 0; b < (lens[i] + bs - 1) / bs; b++)
            if (t[b] < 0 || t[b] >= nb) return -4;
    }
    return 0;
}

/* out[m, hidden] = final_norm(stack(h)) for m single-token sequences: row i is the token
 * at pos[i] of the sequence whose block table is tables + i * table_stride, its K/V goes to
 * cache slot slots[i] (negative: not written) and it attends to lens[i] positions. The
 * rotary table cs is [max_pos, rot] (cos | sin), NeoX style. Returns 0; -1 when scratch
 * memory is short; -2, -3, -4 for a position, a slot, a block table/length out of range. */
int epd_decode_stack(float *out, const float *h, const int64_t *layers, const float *final_norm,
                     const float *cs, const int64_t *pos, const int64_t *slots,
                     const int32_t *tables, const int32_t *lens, const int64_t *dm, float eps,
                     float scale) {
    const int64_t m = dm[D_ROWS], hid = dm[D_HIDDEN], hq = dm[D_HQ], hkv = dm[D_HKV];
    const int64_t d = dm[D_HEAD], inter = dm[D_INTER], bs = dm[D_BLOCK];
    const int64_t qs = hq * d, kvs = hkv * d, qkvw = qs + 2 * kvs;
    int rc = check_step(dm, pos, slots, tables, lens);
    if (rc) return rc;

    const int64_t need = m * (2 * hid + qkvw + qs + kvs + qs + hid + 3 * inter) + 2 * m;
    float *buf = malloc(sizeof(float) * (size_t)need);
    if (!buf) return -1;
    float *resid = buf, *x = resid + m * hid, *qkv = x + m * hid, *q = qkv + m * qkvw;
    float *k = q + m * qs, *att = k + m * kvs, *o = att + m * qs, *gu = o + m * hid;
    float *act = gu + m * 2 * inter;
    int64_t *rows = (int64_t *)(act + m * inter); /* 0 .. m-1: query row = table row */
    for (int64_t i = 0; i < m; i++) rows[i] = i;

    const float *cur = h; /* the layer's input: the embeddings, then each MLP's output */
    for (int64_t l = 0; l < dm[D_LAYERS]; l++) {
        const int64_t *L = layers + l * L_NPTR;
        if (l == 0) { /* the residual stream starts as the embeddings */
            memcpy(resid, h, sizeof(float) * (size_t)(m * hid));
            epd_rms_norm(x, NULL, h, NULL, P(L, L_IN_NORM), m, hid, eps);
        } else {
            epd_rms_norm(x, resid, cur, resid, P(L, L_IN_NORM), m, hid, eps);
        }
        epd_gemv_t(qkv, qkvw, x, P(L, L_QKV_WT), qkvw, P(L, L_QKV_B), m, hid, qkvw);
        for (int64_t i = 0; i < m; i++) {
            memcpy(q + i * qs, qkv + i * qkvw, sizeof(float) * (size_t)qs);
            memcpy(k + i * kvs, qkv + i * qkvw + qs, sizeof(float) * (size_t)kvs);
        }
        if (L[L_Q_NORM]) {
            epd_rms_norm(q, NULL, q, NULL, P(L, L_Q_NORM), m * hq, d, eps);
            epd_rms_norm(k, NULL, k, NULL, P(L, L_K_NORM), m * hkv, d, eps);
        }
        epd_rotary(q, k, pos, cs, m, hq, hkv, d, dm[D_ROT], 1);
        float *kc = (float *)(intptr_t)L[L_K_CACHE], *vc = (float *)(intptr_t)L[L_V_CACHE];
        for (int64_t i = 0; i < m; i++) {
            if (slots[i] < 0) continue;
            memcpy(kc + slots[i] * kvs, k + i * kvs, sizeof(float) * (size_t)kvs);
            memcpy(vc + slots[i] * kvs, qkv + i * qkvw + qs + kvs, sizeof(float) * (size_t)kvs);
        }
        if (epd_decode_attention(att, q, kc, vc, tables, dm[D_TABLE_STRIDE], lens, rows, rows,
                                 m, hq, hkv, d, bs, scale)) {
            free(buf);
            return -1;
        }
        epd_gemv_t(o, hid, att, P(L, L_O_WT), hid, P(L, L_O_B), m, qs, hid);
        epd_rms_norm(x, resid, o, resid, P(L, L_POST_NORM), m, hid, eps);
        epd_gemv_t(gu, 2 * inter, x, P(L, L_GU_WT), 2 * inter, P(L, L_GU_B), m, hid, 2 * inter);
        epd_silu_mul(act, gu, m, inter);
        epd_gemv_t(o, hid, act, P(L, L_DOWN_WT), hid, P(L, L_DOWN_B), m, inter, hid);
        cur = o;
    }
    epd_rms_norm(out, resid, cur, resid, final_norm, m, hid, eps);
    free(buf);
    return 0;
}
