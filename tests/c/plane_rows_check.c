/* Checks include/plane_rows.h's row loops against plain reference loops, for float and
 * double, every step 1..3 and row lengths around each vector chunk width. Built four times
 * by tests/test_plane_rows.py: with the stride-2 vector shuffles and without them
 * (-DDYNAR_VECTOR_SHUFFLES=0, the path of compilers that lack them), each with float chunks
 * of up to 16 and of up to 8 elements (-DDYNAR_ROW_CHUNK_FLOATS), all under
 * AddressSanitizer: every source row is its own allocation of exactly the elements a row
 * of that length and step covers, so a vector load past a row's last element is reported.
 * Prints the cases it ran and exits 1 on the first difference. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "plane_rows.h"

static unsigned long long rng_state = 12345;

static double next_value(void)
{
    rng_state = rng_state * 6364136223846793005ULL + 1442695040888963407ULL;
    return (double)(rng_state >> 40) / (double)(1ULL << 24) - 0.5;
}

#define CHECK_ROWS(REAL, SUFFIX)                                                              \
static int check_##SUFFIX(ptrdiff_t wo, ptrdiff_t lo, ptrdiff_t hi, ptrdiff_t step)          \
{                                                                                             \
    /* One row at a time: a row's source is exactly (hi - lo - 1) * step + 1 elements. */     \
    const ptrdiff_t span = hi > lo ? (hi - lo - 1) * step + 1 : 0;                            \
    REAL *src = malloc((span ? span : 1) * sizeof(REAL));                                     \
    REAL *cols = malloc(wo * sizeof(REAL)), *want = malloc(wo * sizeof(REAL));                \
    REAL *plane = malloc((span ? span : 1) * sizeof(REAL));                                   \
    REAL *plane_want = malloc((span ? span : 1) * sizeof(REAL));                              \
    int bad = 0;                                                                              \
    for (ptrdiff_t k = 0; k < span; k++) {                                                    \
        src[k] = (REAL)next_value();                                                          \
        plane[k] = plane_want[k] = (REAL)next_value();                                        \
    }                                                                                         \
    for (ptrdiff_t o = 0; o < wo; o++) {                                                      \
        cols[o] = (REAL)next_value();                                                         \
        want[o] = o >= lo && o < hi ? src[(o - lo) * step] : 0;                               \
    }                                                                                         \
    rows_unfold_##SUFFIX(cols, src, 1, span, wo, lo, hi, step);                               \
    bad |= memcmp(cols, want, wo * sizeof(REAL)) != 0;                                        \
    for (ptrdiff_t o = lo; o < hi; o++)                                                       \
        plane_want[(o - lo) * step] += want[o];                                               \
    rows_fold_add_##SUFFIX(plane, want, 1, span, wo, lo, hi, step);                           \
    bad |= memcmp(plane, plane_want, (span ? span : 1) * sizeof(REAL)) != 0;                  \
    if (bad)                                                                                  \
        fprintf(stderr, #REAL ": wo %td lo %td hi %td step %td differs\n", wo, lo, hi, step); \
    free(src); free(cols); free(want); free(plane); free(plane_want);                         \
    return bad;                                                                               \
}

CHECK_ROWS(float, f)
CHECK_ROWS(double, d)

int main(void)
{
    long cases = 0;
    for (ptrdiff_t wo = 1; wo <= 40; wo++)
        for (ptrdiff_t lo = 0; lo <= 3 && lo < wo; lo++)
            for (ptrdiff_t hi = lo; hi <= wo; hi++)
                for (ptrdiff_t step = 1; step <= 3; step++, cases++)
                    if (check_f(wo, lo, hi, step) || check_d(wo, lo, hi, step))
                        return 1;
    printf("vector shuffles %d: %ld cases agree\n", DYNAR_VECTOR_SHUFFLES, cases);
    return 0;
}
