/* The layer-by-layer path's kernels split over threads: each epd_par_* runs its kernel over
 * the ranges [b[r], b[r + 1]) of rows (or columns, or tile units), one range per thread,
 * on an OpenMP team.
 *
 * Built with -fopenmp, this library links libgomp.so.1, and loaded after torch, whose
 * libgomp has that soname, the dynamic linker binds it to torch's own copy: the team is
 * the one torch's matmuls run on, already awake between ops. The ranges went to a Python
 * ThreadPoolExecutor before (a submit and a wait per op, ~80 a step); at 2 threads those
 * ops got slower than at 1, their pool thread waiting for the core torch's OpenMP worker
 * spun on after each matmul. Without OpenMP the pragmas are ignored and the ranges run
 * one after another on the calling thread. The splits are the caller's, so results are
 * bitwise those of one call per range. */
#include "epd_common.h"

#define RANGES _Pragma("omp parallel for num_threads(nr) schedule(static, 1) if (nr > 1)")
#define KEEP_ERROR(rc)                                                                      \
    if (rc) {                                                                               \
        _Pragma("omp atomic write") err = rc;                                               \
    }

/* 1 when built with OpenMP (the ranges run in parallel), else 0. */
int epd_openmp(void) {
#ifdef _OPENMP
    return 1;
#else
    return 0;
#endif
}

int epd_par_decode_attention(float *out, const float *q, const float *kc, const float *vc,
                             const int32_t *tables, int64_t ts, const int32_t *lens,
                             const int64_t *rows, const int64_t *seqs, int64_t hq, int64_t hkv,
                             int64_t d, int64_t bs, float scale, const int64_t *b, int64_t nr) {
    int err = 0;
    RANGES
    for (int64_t r = 0; r < nr; r++) {
        const int64_t lo = b[r];
        int rc = epd_decode_attention(out, q, kc, vc, tables, ts, lens + lo, rows + lo,
                                      seqs + lo, b[r + 1] - lo, hq, hkv, d, bs, scale);
        KEEP_ERROR(rc)
    }
    return err;
}

int epd_par_decode_attention_q8(float *out, const float *q, const void *kc, const void *vc,
                                const int32_t *tables, int64_t ts, const int32_t *lens,
                                const int64_t *rows, const int64_t *seqs, int64_t hq, int64_t hkv,
                                int64_t d, int64_t bs, float scale, int fp8, const int64_t *b,
                                int64_t nr) {
    int err = 0;
    RANGES
    for (int64_t r = 0; r < nr; r++) {
        const int64_t lo = b[r];
        int rc = epd_decode_attention_q8(out, q, kc, vc, tables, ts, lens + lo, rows + lo,
                                         seqs + lo, b[r + 1] - lo, hq, hkv, d, bs, scale, fp8);
        KEEP_ERROR(rc)
    }
    return err;
}

int epd_par_extend_attention(float *out, const float *q, const float *kc, const float *vc,
                             const int32_t *tables, int64_t ts, const int64_t *units, int64_t hq,
                             int64_t hkv, int64_t d, int64_t bs, float scale, const int64_t *b,
                             int64_t nr) {
    int err = 0;
    RANGES
    for (int64_t r = 0; r < nr; r++) {
        const int64_t lo = b[r];
        int rc = epd_extend_attention(out, q, kc, vc, tables, ts, units + 5 * lo, b[r + 1] - lo,
                                      hq, hkv, d, bs, scale);
        KEEP_ERROR(rc)
    }
    return err;
}

/* y[m, n] = x[m, k] @ W^T (+ bias), the columns split: W^T row-major [k, n] (transposed)
 * or W row-major [n, k]. */
void epd_par_gemv(float *y, const float *x, const float *w, const float *bias, int64_t m,
                  int64_t k, int64_t n, int transposed, const int64_t *b, int64_t nr) {
    RANGES
    for (int64_t r = 0; r < nr; r++) {
        const int64_t lo = b[r], cols = b[r + 1] - lo;
        const float *bl = bias ? bias + lo : NULL;
        if (transposed) epd_gemv_t(y + lo, n, x, w + lo, n, bl, m, k, cols);
        else epd_gemv_rm(y + lo, n, x, w + lo * k, k, bl, m, k, cols);
    }
}

/* epd_qgemv_i8 / epd_qgemv_i4 (epd_quant.c) with the panels split. */
void epd_par_qgemv_i8(float *y, const float *x, int64_t m, int64_t k, int64_t n,
                      const int8_t *qw, const float *scale, const float *bias, const int64_t *b,
                      int64_t nr) {
    RANGES
    for (int64_t r = 0; r < nr; r++) epd_qgemv_i8(y, n, x, k, m, k, n, qw, scale, bias, b[r], b[r + 1]);
}

void epd_par_qgemv_i4(float *y, const float *x, const float *xs, int64_t m, int64_t k,
                      int64_t n, int64_t group, const uint8_t *qw, const float *scale,
                      const float *offset, int64_t lds, const float *bias, const int64_t *b,
                      int64_t nr) {
    RANGES
    for (int64_t r = 0; r < nr; r++)
        epd_qgemv_i4(y, n, x, k, xs, m, k, n, group, qw, scale, offset, lds, bias, b[r], b[r + 1]);
}

void epd_par_silu_mul(float *out, const float *x, int64_t h, const int64_t *b, int64_t nr) {
    RANGES
    for (int64_t r = 0; r < nr; r++)
        epd_silu_mul(out + b[r] * h, x + b[r] * 2 * h, b[r + 1] - b[r], h);
}

void epd_par_rms_norm(float *out, float *res_out, const float *x, const float *resid,
                      const float *w, int64_t h, float eps, const int64_t *b, int64_t nr) {
    RANGES
    for (int64_t r = 0; r < nr; r++) {
        const int64_t o = b[r] * h;
        epd_rms_norm(out + o, res_out ? res_out + o : NULL, x + o, resid ? resid + o : NULL, w,
                     b[r + 1] - b[r], h, eps);
    }
}

void epd_par_rotary(float *q, float *k, const int64_t *pos, const float *cs, int64_t hq,
                    int64_t hkv, int64_t d, int64_t rot, int neox, const int64_t *b, int64_t nr) {
    RANGES
    for (int64_t r = 0; r < nr; r++)
        epd_rotary(q + b[r] * hq * d, k + b[r] * hkv * d, pos + b[r], cs, b[r + 1] - b[r], hq, hkv,
                   d, rot, neox);
}

void epd_par_argmax(int64_t *out, const float *x, int64_t n, const int64_t *b, int64_t nr) {
    RANGES
    for (int64_t r = 0; r < nr; r++) epd_argmax(out + b[r], x + b[r] * n, b[r + 1] - b[r], n);
}

/* epd_screen_argmax over row ranges; the rows left to the caller, summed (-1: no scratch). */
int64_t epd_par_screen_argmax(int64_t *out, const uint16_t *s, const float *x, const float *w,
                              const float *wn, const float *dwn, const float *p, const float *q,
                              int64_t k, int64_t n, int transposed, int64_t cap, const int64_t *b,
                              int64_t nr) {
    int64_t left = 0;
    int err = 0;
    RANGES
    for (int64_t r = 0; r < nr; r++) {
        const int64_t lo = b[r];
        const int64_t got = epd_screen_argmax(out + lo, s + lo * n, x + lo * k, w, wn, dwn, p + lo,
                                              q + lo, b[r + 1] - lo, k, n, transposed, cap);
        if (got < 0) {
            KEEP_ERROR(1)
        } else {
            _Pragma("omp atomic") left += got;
        }
    }
    return err ? -1 : left;
}

/* epd_gemv_bf16 over column ranges of W^T [k, n] (and of s). */
int epd_par_gemv_bf16(uint16_t *s, const uint16_t *xb, const uint16_t *wt, int64_t m,
                      int64_t k, int64_t n, const int64_t *b, int64_t nr) {
    int err = 0;
    RANGES
    for (int64_t r = 0; r < nr; r++) {
        int rc = epd_gemv_bf16(s + b[r], n, xb, wt + b[r], n, m, k, b[r + 1] - b[r]);
        KEEP_ERROR(rc)
    }
    return err;
}

/* The one-call decoder step (epd_decode.c) by a team of nt threads of the same OpenMP
 * team, thread t as tid t; codes[t] its return. The step's own barrier needs every
 * teammate running at once: a team OpenMP cannot fill comes short, and its barrier
 * times out (-5) rather than hang. */
#ifdef _OPENMP
#include <omp.h>
#define TEAM_TID ((int64_t)omp_get_thread_num())
#else
#define TEAM_TID ((int64_t)0)
#endif
#define TEAM _Pragma("omp parallel num_threads(nt) if (nt > 1)")

void epd_par_decode_stack(float *out, float *aux, const int64_t *aux_cols, int64_t aux_stride,
                          const float *h, const int64_t *layers, const float *final_norm,
                          const float *cs, const int64_t *pos, const int64_t *slots,
                          const int32_t *tables, const int32_t *lens, const int64_t *dm,
                          float eps, float scale, float *scratch, int64_t *sync, int64_t nt,
                          int *codes) {
    TEAM {
        const int64_t tid = TEAM_TID;
        codes[tid] = epd_decode_stack(out, aux, aux_cols, aux_stride, h, layers, final_norm, cs,
                                      pos, slots, tables, lens, dm, eps, scale, scratch, sync,
                                      tid, nt);
    }
}

void epd_par_decode_greedy(int64_t *tokens_out, const int64_t *tokens_in, const float *embed,
                           const float *head, int head_transposed, int64_t vocab, int64_t steps,
                           const int64_t *layers, const float *final_norm, const float *cs,
                           const int64_t *pos0, const int32_t *tables, const int32_t *lens0,
                           const int64_t *dm, float eps, float scale, float *scratch,
                           int64_t *sync, int64_t nt, int *codes) {
    TEAM {
        const int64_t tid = TEAM_TID;
        codes[tid] = epd_decode_greedy(tokens_out, tokens_in, embed, head, head_transposed, vocab,
                                       steps, layers, final_norm, cs, pos0, tables, lens0, dm, eps,
                                       scale, scratch, sync, tid, nt);
    }
}
