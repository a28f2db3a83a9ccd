/* A team of threads running one native step (epd_decode.c): its barrier and its GEMV,
 * split by weight rows. Every thread of the team calls the same function with its index. */
#ifndef EPD_TEAM_H
#define EPD_TEAM_H

#include <stdint.h>

/* Scratch of a team's GEMVs: per thread, partial outputs [m, n] and its slice of x. */
typedef struct {
    float *part, *xs;
    int64_t part_stride, xs_stride; /* floats per thread */
    int64_t *sync;
} team_t;

/* Barrier of nt threads over sync = [arrived, generation, error, timeout in ms (0: the
 * default)]; returns the team's error (0 if none). */
int64_t epd_team_sync(int64_t *sync, int64_t nt);
/* Records the team's first error (a barrier then returns it to every thread). */
void epd_team_fail(int64_t *sync, int64_t rc);
/* y[m, :n] = x[m, :k] @ wt (+ bias) by the team (see epd_team.c). */
int64_t epd_gemv_team(float *y, const float *x, const float *wt, const float *bias, int64_t m,
                      int64_t k, int64_t n, const team_t *tm, int64_t tid, int64_t nt);

#endif
