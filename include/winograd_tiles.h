/* Tile kernels of the Winograd F(2x2, 3x3) convolution (pyx/winograd.pyx).
 *
 * A tile's 16 transformed values live in 16 "streams" (position xi at stream pointer +
 * xi * stride). Two families vectorize along different axes:
 *   row kernels   one row of tiles of one image: tile tx covers band columns 2tx .. 2tx+3
 *                 and sits at offset tx of each stream; vectors run across the row.
 *   lane kernels  every tile of a plane for L images at once, the images innermost (a plane
 *                 is stored position-major, L values per position, and tile k's values sit
 *                 at offset k*L + image); vectors run across the images. For small planes,
 *                 whose rows are too short to fill a vector.
 * They are in C for `restrict`: with 16 output streams Cython cannot declare non-aliasing,
 * and the compiler then leaves these loops scalar. Instantiated for float (_f) and double
 * (_d).
 *
 * The transforms (Lavin & Gray's F(2x2, 3x3)), each applied down the columns, then along
 * the rows of a tile:
 *   input   B^T d B,  B^T = [1 0 -1 0; 0 1 1 0; 0 -1 1 0; 0 1 0 -1]
 *   output  A^T m A,  A^T = [1 1 1 0; 0 1 -1 -1]
 * and, for backward, their adjoints A g A^T and B v B^T.
 */
#ifndef DYNAR_WINOGRAD_ROWS_H
#define DYNAR_WINOGRAD_ROWS_H
#include <stddef.h>

#define WINO_REAL float
#define WINO_NAME(name) name##_f
#include "winograd_tiles.inc"
#undef WINO_REAL
#undef WINO_NAME

#define WINO_REAL double
#define WINO_NAME(name) name##_d
#include "winograd_tiles.inc"
#undef WINO_REAL
#undef WINO_NAME

#endif
