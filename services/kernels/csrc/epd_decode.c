/* A whole decode step of a Llama-family decoder stack in one call (the "cpu" backend's
 * decode_stack; see epd_cpu.c for how the library is built).
 *
 * Batch-1 decode reads every weight once per token, so it is bound by memory bandwidth;
 * issued op by op from Python, the ~10 ops of each layer cost about as much again in
 * dispatch. This file chains the same kernels (epd_gemv_t, epd_rms_norm, epd_rotary,
 * epd_decode_attention, epd_silu_mul) in the same order and on the same buffers' layouts
 * as services/models/llama.py does through the backend, so at one thread its results are
 * bitwise those of the op-by-op path.
 *
 * Several threads run a step as a team: every thread calls epd_decode_stack with its index;
 * each GEMV is split by weight rows (see epd_team.c), the per-row ops (norms, rotary, K/V
 * writes, attention) by sequence, with a barrier between stages.
 */
#include "epd_common.h"
#include "epd_team.h"

/* Per-layer pointers, in this order (0 where a model has no such tensor). Weights are
 * W^T row-major ([in, out]), the layout models keep on CPU, or quantized: then the
 * linear's L_*_Q entry points at its descriptor (see linear_team) and its W^T entry is 0. */
enum {
    L_IN_NORM, L_QKV_WT, L_QKV_B, L_Q_NORM, L_K_NORM, L_O_WT, L_O_B, L_POST_NORM,
    L_GU_WT, L_GU_B, L_DOWN_WT, L_DOWN_B, L_K_CACHE, L_V_CACHE,
    L_QKV_Q, L_O_Q, L_GU_Q, L_DOWN_Q, L_NPTR
};

#define P(l, i) ((const float *)(intptr_t)(l)[i])

/* A quantized linear's descriptor: int64 [bits, group, scale stride, codes, scale, offset]
 * (services/kernels/quant.py; csrc/epd_quant.c). */
enum { Q_BITS, Q_GROUP, Q_LDS, Q_CODES, Q_SCALE, Q_OFFSET };

/* y [m, n] = x [m, k] @ W^T + bias by the team: the fp32 GEMV split by weight rows
 * (epd_gemv_team), or a quantized weight's panels split between the threads (each
 * output element summed whole by one thread, as epd_par_qgemv_* sums it). */
static int64_t linear_team(float *y, const float *x, const int64_t *L, int wt, int b, int q,
                           int64_t m, int64_t k, int64_t n, const team_t *tm, int64_t tid,
                           int64_t nt) {
    const float *bias = P(L, b);
    if (!L[q]) return epd_gemv_team(y, x, P(L, wt), bias, m, k, n, tm, tid, nt);
    const int64_t *dq = (const int64_t *)(intptr_t)L[q], panels = (n + 15) / 16;
    const int64_t p0 = panels * tid / nt, p1 = panels * (tid + 1) / nt;
    const float *scale = (const float *)(intptr_t)dq[Q_SCALE];
    if (dq[Q_BITS] == 8) {
        epd_qgemv_i8(y, n, x, k, m, k, n, (const int8_t *)(intptr_t)dq[Q_CODES], scale, bias, p0,
                     p1);
        return 0;
    }
    float *sums = tm->xs + tid * tm->xs_stride; /* m * k / group floats */
    epd_group_sums(sums, x, k, m, k, dq[Q_GROUP]);
    epd_qgemv_i4(y, n, x, k, sums, m, k, n, dq[Q_GROUP], (const uint8_t *)(intptr_t)dq[Q_CODES],
                 scale, (const float *)(intptr_t)dq[Q_OFFSET], dq[Q_LDS], bias, p0, p1);
    return 0;
}

/* Sizes, in this order. */
enum {
    D_ROWS, D_HIDDEN, D_HQ, D_HKV, D_HEAD, D_INTER, D_ROT, D_MAX_POS, D_NUM_BLOCKS,
    D_BLOCK, D_TABLE_STRIDE, D_TABLE_WIDTH, D_LAYERS, D_KV_FORMAT, D_NDIMS
};
/* D_KV_FORMAT: 0 float caches, else rows of codes and their scales (csrc/epd_kvq8.c): 1
 * int8 codes, 2 fp8 ones. */


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

/* One token's K and V (hkv heads of d floats each) into its cache slot, as they are or as
 * rows of codes (format: D_KV_FORMAT's) with their scales. */
static void write_kv(void *kc, void *vc, int64_t slot, const float *k, const float *v,
                     int64_t hkv, int64_t d, int64_t format) {
    if (format) {
        epd_kv_quantize((uint8_t *)kc + slot * hkv * (d + 4), k, hkv, d, format == 2);
        epd_kv_quantize((uint8_t *)vc + slot * hkv * (d + 4), v, hkv, d, format == 2);
        return;
    }
    memcpy((float *)kc + slot * hkv * d, k, sizeof(float) * (size_t)(hkv * d));
    memcpy((float *)vc + slot * hkv * d, v, sizeof(float) * (size_t)(hkv * d));
}

static int64_t max3(int64_t a, int64_t b, int64_t c) {
    const int64_t ab = a > b ? a : b;
    return ab > c ? ab : c;
}

/* Floats of scratch a step of dm's sizes needs with a team of nt threads (the caller
 * allocates it; the team shares it). */
int64_t epd_decode_scratch(const int64_t *dm, int64_t nt) {
    const int64_t m = dm[D_ROWS], hid = dm[D_HIDDEN], inter = dm[D_INTER];
    const int64_t qs = dm[D_HQ] * dm[D_HEAD], kvs = dm[D_HKV] * dm[D_HEAD];
    /* row ids (2 floats each), resid, x, qkv, q, k, att, o, gate_up, act */
    const int64_t own = 2 * m + m * (2 * hid + (qs + 2 * kvs) + qs + kvs + qs + hid + 3 * inter);
    /* per thread: a partial output as wide as the widest GEMV, and its slice of x (at one
     * thread only the latter is used: an int4 linear's group sums, see linear_team) */
    return own + nt * m * (max3(qs + 2 * kvs, hid, 2 * inter) + max3(hid, qs, inter));
}

/* Where a step copies the outputs of chosen layers (draft heads' inputs): layer l's output
 * (residual stream after the layer) of row i goes to out + i * stride + cols[l] (cols[l] <
 * 0: not captured). */
typedef struct {
    float *out;
    const int64_t *cols;
    int64_t stride;
} aux_t;

static int stack_step(float *out, const aux_t *aux, const float *h, const int64_t *layers,
                      const float *final_norm, const float *cs, const int64_t *pos,
                      const int64_t *slots, const int32_t *tables, const int32_t *lens,
                      const int64_t *dm, float eps, float scale, float *scratch, int64_t *sync,
                      int64_t tid, int64_t nt);

/* out[m, hidden] = final_norm(stack(h)) for m query rows: row i is the token at pos[i] of
 * the sequence whose block table is tables + i * table_stride, its K/V goes to cache slot
 * slots[i] (negative: not written) and it attends to lens[i] positions. Several rows may
 * be one sequence's (a verification: consecutive positions, lens[i] = pos[i] + 1): every
 * row's K/V is written before any row attends, so causality holds across them. The
 * rotary table cs is [max_pos, rot] (cos | sin), NeoX style. scratch holds
 * epd_decode_scratch(dm, nt) floats (8-byte aligned) and sync four int64s (see epd_team_sync),
 * zeroed or as a successful step left them; the nt threads of the team share both; this
 * is thread tid. With aux (else NULL), layer l's output of row i also goes to
 * aux + i * aux_stride + aux_cols[l] when aux_cols[l] >= 0 (the inputs of a draft head).
 * Returns 0; -1 when scratch memory for the attention is short; -2, -3, -4
 * for a position, a slot, a block table/length out of range; -5 when a teammate never
 * came. */
int epd_decode_stack(float *out, float *aux, const int64_t *aux_cols, int64_t aux_stride,
                     const float *h, const int64_t *layers, const float *final_norm,
                     const float *cs, const int64_t *pos, const int64_t *slots,
                     const int32_t *tables, const int32_t *lens, const int64_t *dm, float eps,
                     float scale, float *scratch, int64_t *sync, int64_t tid, int64_t nt) {
    const int rc = check_step(dm, pos, slots, tables, lens); /* same verdict on every thread */
    if (rc) return rc;
    const aux_t a = {aux, aux_cols, aux_stride};
    return stack_step(out, aux ? &a : NULL, h, layers, final_norm, cs, pos, slots, tables, lens,
                      dm, eps, scale, scratch, sync, tid, nt);
}

/* epd_decode_stack's step once its indices are checked. */
static int stack_step(float *out, const aux_t *aux, const float *h, const int64_t *layers,
                      const float *final_norm, const float *cs, const int64_t *pos,
                      const int64_t *slots, const int32_t *tables, const int32_t *lens,
                      const int64_t *dm, float eps, float scale, float *scratch, int64_t *sync,
                      int64_t tid, int64_t nt) {
    const int64_t m = dm[D_ROWS], hid = dm[D_HIDDEN], hq = dm[D_HQ], hkv = dm[D_HKV];
    const int64_t d = dm[D_HEAD], inter = dm[D_INTER], bs = dm[D_BLOCK];
    const int64_t qs = hq * d, kvs = hkv * d, qkvw = qs + 2 * kvs;
    int64_t *rows = (int64_t *)scratch; /* rows[i] = i: query row = table row (aligned first) */
    float *resid = scratch + 2 * m, *x = resid + m * hid, *qkv = x + m * hid, *q = qkv + m * qkvw;
    float *k = q + m * qs, *att = k + m * kvs, *o = att + m * qs, *gu = o + m * hid;
    float *act = gu + m * 2 * inter;
    const int64_t pstride = m * max3(qkvw, hid, 2 * inter), xstride = m * max3(hid, qs, inter);
    const team_t tm = {act + m * inter, act + m * inter + nt * pstride, pstride, xstride, sync};
    for (int64_t i = tid; i < m; i += nt) rows[i] = i;
    int64_t err = 0;

    const float *cur = h; /* the layer's input: the embeddings, then each MLP's output */
    for (int64_t l = 0; l < dm[D_LAYERS]; l++) {
        const int64_t *L = layers + l * L_NPTR;
        for (int64_t i = tid; i < m; i += nt) {
            if (l == 0) { /* the residual stream starts as the embeddings */
                memcpy(resid + i * hid, h + i * hid, sizeof(float) * (size_t)hid);
                epd_rms_norm(x + i * hid, NULL, h + i * hid, NULL, P(L, L_IN_NORM), 1, hid, eps);
            } else {
                epd_rms_norm(x + i * hid, resid + i * hid, cur + i * hid, resid + i * hid,
                             P(L, L_IN_NORM), 1, hid, eps);
            }
        }
        if ((err = epd_team_sync(sync, nt))) break;
        err = linear_team(qkv, x, L, L_QKV_WT, L_QKV_B, L_QKV_Q, m, hid, qkvw, &tm, tid, nt);
        if (err || (err = epd_team_sync(sync, nt))) break;
        void *kc = (void *)(intptr_t)L[L_K_CACHE], *vc = (void *)(intptr_t)L[L_V_CACHE];
        for (int64_t i = tid; i < m; i += nt) {
            float *qi = q + i * qs, *ki = k + i * kvs;
            const float *vi = qkv + i * qkvw + qs + kvs;
            memcpy(qi, qkv + i * qkvw, sizeof(float) * (size_t)qs);
            memcpy(ki, qkv + i * qkvw + qs, sizeof(float) * (size_t)kvs);
            if (L[L_Q_NORM]) {
                epd_rms_norm(qi, NULL, qi, NULL, P(L, L_Q_NORM), hq, d, eps);
                epd_rms_norm(ki, NULL, ki, NULL, P(L, L_K_NORM), hkv, d, eps);
            }
            epd_rotary(qi, ki, pos + i, cs, 1, hq, hkv, d, dm[D_ROT], 1);
            if (slots[i] >= 0) write_kv(kc, vc, slots[i], ki, vi, hkv, d, dm[D_KV_FORMAT]);
        }
        /* Every row's K/V is in the cache before any row attends: rows of one sequence (a
         * verification's drafts) read each other's, whichever thread wrote them. */
        if ((err = epd_team_sync(sync, nt))) break;
        for (int64_t i = tid; i < m; i += nt)
            if (dm[D_KV_FORMAT] ? epd_decode_attention_q8(att, q, kc, vc, tables,
                                                          dm[D_TABLE_STRIDE], lens + i, rows + i,
                                                          rows + i, 1, hq, hkv, d, bs, scale,
                                                          dm[D_KV_FORMAT] == 2)
                              : epd_decode_attention(att, q, kc, vc, tables, dm[D_TABLE_STRIDE],
                                                     lens + i, rows + i, rows + i, 1, hq, hkv, d,
                                                     bs, scale))
                epd_team_fail(sync, -1);
        if ((err = epd_team_sync(sync, nt))) break;
        err = linear_team(o, att, L, L_O_WT, L_O_B, L_O_Q, m, qs, hid, &tm, tid, nt);
        if (err || (err = epd_team_sync(sync, nt))) break;
        for (int64_t i = tid; i < m; i += nt)
            epd_rms_norm(x + i * hid, resid + i * hid, o + i * hid, resid + i * hid,
                         P(L, L_POST_NORM), 1, hid, eps);
        if ((err = epd_team_sync(sync, nt))) break;
        err = linear_team(gu, x, L, L_GU_WT, L_GU_B, L_GU_Q, m, hid, 2 * inter, &tm, tid, nt);
        if (err || (err = epd_team_sync(sync, nt))) break;
        for (int64_t i = tid; i < m; i += nt)
            epd_silu_mul(act + i * inter, gu + i * 2 * inter, 1, inter);
        if ((err = epd_team_sync(sync, nt))) break;
        err = linear_team(o, act, L, L_DOWN_WT, L_DOWN_B, L_DOWN_Q, m, inter, hid, &tm, tid, nt);
        if (err || (err = epd_team_sync(sync, nt))) break;
        cur = o;
        /* The layer's output, MLP output + residual as the layer path sums it; each thread
         * reads back only its own rows next, so no barrier. */
        if (aux && aux->cols[l] >= 0)
            for (int64_t i = tid; i < m; i += nt) {
                float *dst = aux->out + i * aux->stride + aux->cols[l];
                for (int64_t c = 0; c < hid; c++) dst[c] = o[i * hid + c] + resid[i * hid + c];
            }
    }
    if (err) return (int)err;
    for (int64_t i = tid; i < m; i += nt)
        epd_rms_norm(out + i * hid, resid + i * hid, cur + i * hid, resid + i * hid, final_norm, 1,
                     hid, eps);
    return 0;
}

#define GREEDY_MAX_ROWS 64 /* per-thread copies of the step's indices live on the stack */

/* Floats of scratch epd_decode_greedy needs: a step's (epd_decode_scratch), then the
 * embeddings and hidden states [m, hidden] and the logits [m, vocab] of one step. */
int64_t epd_decode_greedy_scratch(const int64_t *dm, int64_t nt, int64_t vocab) {
    const int64_t step = (epd_decode_scratch(dm, nt) + 15) / 16 * 16; /* keeps h aligned */
    return step + dm[D_ROWS] * (2 * dm[D_HIDDEN] + vocab);
}

/* `steps` greedy decode steps of m sequences in one call: step s embeds token t_s (t_0 =
 * tokens_in) at position pos0[i] + s of row i, runs the stack (epd_decode_stack; the K/V
 * slot is the block table's: the tables must already cover pos0[i] + steps - 1 and lens0
 * counts step 0's context), takes the LM head W [vocab, hidden] and its argmax: t_{s+1},
 * written to tokens_out[s * m + i]. head holds W^T row-major (head_transposed = 1,
 * epd_gemv_t) or W row-major (0, epd_gemv_rm). Those are the kernels and the order of a
 * step through epd_decode_stack then epd_gemv_argmax, so at one thread the tokens and K/V
 * writes are bitwise theirs. A team splits the head by vocabulary entries (each logit is
 * summed as one thread would); every thread then takes the same argmax. Returns as
 * epd_decode_stack does, or -6 for a token outside the embedding table. */
int epd_decode_greedy(int64_t *tokens_out, const int64_t *tokens_in, const float *embed,
                      const float *head, int head_transposed, int64_t vocab, int64_t steps,
                      const int64_t *layers, const float *final_norm, const float *cs,
                      const int64_t *pos0, const int32_t *tables, const int32_t *lens0,
                      const int64_t *dm, float eps, float scale, float *scratch, int64_t *sync,
                      int64_t tid, int64_t nt) {
    const int64_t m = dm[D_ROWS], hid = dm[D_HIDDEN], bs = dm[D_BLOCK];
    if (m > GREEDY_MAX_ROWS) return -1;
    int64_t tok[GREEDY_MAX_ROWS], pos[GREEDY_MAX_ROWS], slots[GREEDY_MAX_ROWS];
    int32_t lens[GREEDY_MAX_ROWS];
    for (int64_t i = 0; i < m; i++) {
        if (tokens_in[i] < 0 || tokens_in[i] >= vocab) return -6;
        tok[i] = tokens_in[i];
    }
    float *h = scratch + (epd_decode_scratch(dm, nt) + 15) / 16 * 16;
    float *hn = h + m * hid, *logits = hn + m * hid;
    const int64_t lo = vocab * tid / nt, hi = vocab * (tid + 1) / nt;
    for (int64_t s = 0; s < steps; s++) {
        for (int64_t i = 0; i < m; i++) {
            pos[i] = pos0[i] + s;
            lens[i] = (int32_t)(lens0[i] + s);
            slots[i] = -1; /* checked with the tables first, then looked up in them */
        }
        int rc = check_step(dm, pos, slots, tables, lens);
        if (rc) return rc;
        for (int64_t i = 0; i < m; i++) {
            if (pos[i] >= lens[i]) return -4; /* the token's own slot is past the table */
            slots[i] = (int64_t)tables[i * dm[D_TABLE_STRIDE] + pos[i] / bs] * bs + pos[i] % bs;
        }
        for (int64_t i = tid; i < m; i += nt)
            memcpy(h + i * hid, embed + tok[i] * hid, sizeof(float) * (size_t)hid);
        rc = stack_step(hn, NULL, h, layers, final_norm, cs, pos, slots, tables, lens, dm, eps,
                        scale, scratch, sync, tid, nt);
        if (rc) return rc;
        int64_t err = epd_team_sync(sync, nt); /* every row's hidden state is in hn */
        if (err) return (int)err;
        if (head_transposed)
            epd_gemv_t(logits + lo, vocab, hn, head + lo, vocab, NULL, m, hid, hi - lo);
        else
            epd_gemv_rm(logits + lo, vocab, hn, head + lo * hid, hid, NULL, m, hid, hi - lo);
        if ((err = epd_team_sync(sync, nt))) return (int)err;
        epd_argmax(tok, logits, m, vocab);
        if (tid == 0)
            for (int64_t i = 0; i < m; i++) tokens_out[s * m + i] = tok[i];
    }
    return 0;
}
