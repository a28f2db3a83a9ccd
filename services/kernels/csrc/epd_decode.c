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
 * each GEMV is split by weight rows (see gemv_team), the per-row ops (norms, rotary, K/V
 * writes, attention) by sequence, with a barrier between stages.
 */
#define _POSIX_C_SOURCE 200809L /* clock_gettime, nanosleep */
#include "epd_common.h"

#include <time.h>

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
    if (nt == 1) return own;
    /* per thread: a partial output as wide as the widest GEMV, and its slice of x */
    return own + nt * m * (max3(qs + 2 * kvs, hid, 2 * inter) + max3(hid, qs, inter));
}

#define TEAM_TIMEOUT_MS 30000 /* a teammate this late is gone: fail the step, never hang */

static double seconds(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

static void team_fail(int64_t *sync, int64_t rc) {
    int64_t zero = 0; /* the first error wins */
    __atomic_compare_exchange_n(&sync[2], &zero, rc, 0, __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE);
}

/* Barrier of nt threads over sync = [arrived, generation, error, timeout in ms (0: the
 * default)]; returns the team's error (0 if none). Spins first (a stage ends within
 * microseconds of its neighbours'), then sleeps in short naps so that a teammate without
 * a CPU of its own can run, and gives up after the timeout. */
static int64_t team_sync(int64_t *sync, int64_t nt) {
    if (nt > 1) {
        const int64_t gen = __atomic_load_n(&sync[1], __ATOMIC_ACQUIRE);
        if (__atomic_add_fetch(&sync[0], 1, __ATOMIC_ACQ_REL) == nt) {
            __atomic_store_n(&sync[0], 0, __ATOMIC_RELAXED);
            __atomic_store_n(&sync[1], gen + 1, __ATOMIC_RELEASE);
        } else {
            const struct timespec nap = {0, 20000};
            const double limit = 1e-3 * (double)(sync[3] > 0 ? sync[3] : TEAM_TIMEOUT_MS);
            double t0 = 0.0;
            for (int64_t spins = 0; __atomic_load_n(&sync[1], __ATOMIC_ACQUIRE) == gen; spins++) {
                if (spins < 2000) {
#if defined(__x86_64__) || defined(__i386__)
                    __builtin_ia32_pause();
#endif
                    continue;
                }
                nanosleep(&nap, NULL);
                if (t0 == 0.0) t0 = seconds();
                else if (spins % 64 == 0 && seconds() - t0 > limit) {
                    team_fail(sync, -5);
                    break;
                }
            }
        }
    }
    return __atomic_load_n(&sync[2], __ATOMIC_ACQUIRE);
}

/* epd_gemv_t for more rows (a verification's): the same sums in the same order, so bitwise
 * its results, with the columns cut in tiles. epd_gemv_t streams eight weight rows once per
 * output row: past four rows that re-read (8 x n floats, up to ~90 KB) comes from L2;
 * here a tile's slice of the eight rows (8 KB) stays in L1 while every output row uses it. */
#define GEMV_TILE 256
static void gemv_rows(float *y, int64_t ldy, const float *x, const float *wt, int64_t ldw,
                      const float *bias, int64_t m, int64_t k, int64_t n) {
    if (m <= 4) {
        epd_gemv_t(y, ldy, x, wt, ldw, bias, m, k, n);
        return;
    }
    for (int64_t r = 0; r < m; r++) {
        if (bias) memcpy(y + r * ldy, bias, sizeof(float) * (size_t)n);
        else memset(y + r * ldy, 0, sizeof(float) * (size_t)n);
    }
    const int64_t g = k / 8, gs = g * ldw;
    for (int64_t i = 0; i < g; i++) {
        const float *w0 = wt + i * ldw, *w1 = w0 + gs, *w2 = w1 + gs, *w3 = w2 + gs;
        const float *w4 = w3 + gs, *w5 = w4 + gs, *w6 = w5 + gs, *w7 = w6 + gs;
        for (int64_t j0 = 0; j0 < n; j0 += GEMV_TILE) {
            const int64_t j1 = j0 + GEMV_TILE < n ? j0 + GEMV_TILE : n;
            for (int64_t r = 0; r < m; r++) {
                const float *a = x + r * k + i;
                const float a0 = a[0], a1 = a[g], a2 = a[2 * g], a3 = a[3 * g];
                const float a4 = a[4 * g], a5 = a[5 * g], a6 = a[6 * g], a7 = a[7 * g];
                float *yr = y + r * ldy;
                for (int64_t j = j0; j < j1; j++)
                    yr[j] += a0 * w0[j] + a1 * w1[j] + a2 * w2[j] + a3 * w3[j] + a4 * w4[j] +
                             a5 * w5[j] + a6 * w6[j] + a7 * w7[j];
            }
        }
    }
    for (int64_t kk = 8 * g; kk < k; kk++)
        for (int64_t r = 0; r < m; r++) axpy(y + r * ldy, x[r * k + kk], wt + kk * ldw, n);
}

/* Scratch of a team's GEMVs: per thread, partial outputs [m, n] and its slice of x. */
typedef struct {
    float *part, *xs;
    int64_t part_stride, xs_stride; /* floats per thread */
    int64_t *sync;
} team_t;

/* y[m, :n] = x[m, :k] @ wt (+ bias) by a team. One thread: epd_gemv_t. Several: thread t
 * streams its own run of wt's k rows into a partial output, then sums every partial over
 * its own slice of the columns. Splitting the rows keeps each thread's read long and
 * sequential (a column split cuts every row into short pieces: no faster than one
 * thread); the sum's order depends on the team's size, so results do too, in the last
 * bits. */
static int64_t gemv_team(float *y, const float *x, const float *wt, const float *bias,
                         int64_t m, int64_t k, int64_t n, const team_t *tm, int64_t tid,
                         int64_t nt) {
    if (nt == 1) {
        gemv_rows(y, n, x, wt, n, bias, m, k, n);
        return 0;
    }
    const int64_t lo = k * tid / nt, hi = k * (tid + 1) / nt;
    float *part = tm->part + tid * tm->part_stride, *xs = tm->xs + tid * tm->xs_stride;
    for (int64_t r = 0; r < m; r++)
        memcpy(xs + r * (hi - lo), x + r * k + lo, sizeof(float) * (size_t)(hi - lo));
    gemv_rows(part, n, xs, wt + lo * n, n, NULL, m, hi - lo, n);
    const int64_t err = team_sync(tm->sync, nt);
    if (err) return err;
    const int64_t chunk = ((n + nt - 1) / nt + 15) / 16 * 16;
    const int64_t c0 = tid * chunk < n ? tid * chunk : n, c1 = c0 + chunk < n ? c0 + chunk : n;
    for (int64_t r = 0; r < m; r++) {
        float *yr = y + r * n;
        for (int64_t j = c0; j < c1; j++) yr[j] = bias ? bias[j] : 0.f;
        for (int64_t t = 0; t < nt; t++) {
            const float *pr = tm->part + t * tm->part_stride + r * n;
            for (int64_t j = c0; j < c1; j++) yr[j] += pr[j];
        }
    }
    return 0;
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
 * epd_decode_scratch(dm, nt) floats (8-byte aligned) and sync four int64s (see team_sync),
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
        if ((err = team_sync(sync, nt))) break;
        err = gemv_team(qkv, x, P(L, L_QKV_WT), P(L, L_QKV_B), m, hid, qkvw, &tm, tid, nt);
        if (err || (err = team_sync(sync, nt))) break;
        float *kc = (float *)(intptr_t)L[L_K_CACHE], *vc = (float *)(intptr_t)L[L_V_CACHE];
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
            if (slots[i] >= 0) {
                memcpy(kc + slots[i] * kvs, ki, sizeof(float) * (size_t)kvs);
                memcpy(vc + slots[i] * kvs, vi, sizeof(float) * (size_t)kvs);
            }
        }
        /* Every row's K/V is in the cache before any row attends: rows of one sequence (a
         * verification's drafts) read each other's, whichever thread wrote them. */
        if ((err = team_sync(sync, nt))) break;
        for (int64_t i = tid; i < m; i += nt)
            if (epd_decode_attention(att, q, kc, vc, tables, dm[D_TABLE_STRIDE], lens + i, rows + i,
                                     rows + i, 1, hq, hkv, d, bs, scale))
                team_fail(sync, -1);
        if ((err = team_sync(sync, nt))) break;
        err = gemv_team(o, att, P(L, L_O_WT), P(L, L_O_B), m, qs, hid, &tm, tid, nt);
        if (err || (err = team_sync(sync, nt))) break;
        for (int64_t i = tid; i < m; i += nt)
            epd_rms_norm(x + i * hid, resid + i * hid, o + i * hid, resid + i * hid,
                         P(L, L_POST_NORM), 1, hid, eps);
        if ((err = team_sync(sync, nt))) break;
        err = gemv_team(gu, x, P(L, L_GU_WT), P(L, L_GU_B), m, hid, 2 * inter, &tm, tid, nt);
        if (err || (err = team_sync(sync, nt))) break;
        for (int64_t i = tid; i < m; i += nt)
            epd_silu_mul(act + i * inter, gu + i * 2 * inter, 1, inter);
        if ((err = team_sync(sync, nt))) break;
        err = gemv_team(o, act, P(L, L_DOWN_WT), P(L, L_DOWN_B), m, inter, hid, &tm, tid, nt);
        if (err || (err = team_sync(sync, nt))) break;
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
        int64_t err = team_sync(sync, nt); /* every row's hidden state is in hn */
        if (err) return (int)err;
        if (head_transposed)
            epd_gemv_t(logits + lo, vocab, hn, head + lo, vocab, NULL, m, hid, hi - lo);
        else
            epd_gemv_rm(logits + lo, vocab, hn, head + lo * hid, hid, NULL, m, hid, hi - lo);
        if ((err = team_sync(sync, nt))) return (int)err;
        epd_argmax(tok, logits, m, vocab);
        if (tid == 0)
            for (int64_t i = 0; i < m; i++) tokens_out[s * m + i] = tok[i];
    }
    return 0;
}
