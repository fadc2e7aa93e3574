/* Matrix products over weights packed in 32-column panels, on CPU: the target model's linear layers
 * (engine/model/panel_linear.py) and the draft chain's (draft_chain.c, which includes this file).
 *
 * Why: at the row counts of decoding (1 to a few hundred rows) torch's float32 linear on this project's CPU hosts
 * ran at a fraction of the machine (the embedded target's 29 linears: 1.7-2.3 ms for one row, 2.4-3.9 ms for five,
 * against 0.26 ms and 0.39 ms here), while a decode step's weights are read once per step and stream best in the
 * order they are used. Here a matrix "out over in" is stored as panels [ceil(out / 32), in, 32], each contiguous,
 * the last zero-padded, and every tile of rows reads its panel once in address order.
 *
 * Batch invariance: every output y[r, j] is summed in the same order whatever the number of rows, the tile the row
 * falls in, its place in the batch and the thread count (two partial sums over even and odd i, added, then the
 * bias). So a row's result is bit for bit the same alone or in any batch: a verify's logits for a draft node are
 * exactly the plain decode's, and a request's output does not depend on what it was batched with.
 *
 * Built by engine/model/native.py (`cc -O3 -fopenmp`, no -march; target_clones pick AVX-512 / AVX2 at load time).
 */

#include <stddef.h>
#include <stdint.h>

#include <omp.h>

#ifndef ORD_CLONES
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define ORD_CLONES __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#else
#define ORD_CLONES
#endif
#define ORD_INLINE static inline __attribute__((always_inline))
#endif

typedef float v16 __attribute__((vector_size(64)));
typedef float v16u __attribute__((vector_size(64), aligned(4))); /* the same, at any float address */
typedef uint16_t v16h __attribute__((vector_size(32), aligned(2)));
typedef uint32_t v16i __attribute__((vector_size(64)));
/* Rows per tile: 6 rows x 2 halves x 2 partial sums are 24 accumulators, which with the panel row's vectors fit the
 * 32 vector registers of AVX-512. A verify of a chain of 4 (5 rows) is one tile. */
enum { TILE_ROWS = 6, PANEL = 32 };

/* Row i of a panel as two float vectors. bf16 panels (weights whose values are bf16 values: the same numbers in half
 * the bytes) widen exactly: a bf16 is the top half of the float32 with the same value. */
ORD_INLINE void panel_row(const void *panel, int64_t i, const int bf16, v16 *w0, v16 *w1) {
    if (bf16) {
        const uint16_t *p = (const uint16_t *)panel + i * PANEL;
        const v16i lo = __builtin_convertvector(*(const v16h *)p, v16i) << 16;
        const v16i hi = __builtin_convertvector(*(const v16h *)(p + 16), v16i) << 16;
        *w0 = (v16)lo;
        *w1 = (v16)hi;
    } else {
        const float *p = (const float *)panel + i * PANEL;
        *w0 = *(const v16u *)p;
        *w1 = *(const v16u *)(p + 16);
    }
}

/* y[r, 0 .. width) for the tile's `rows` rows: acc[k] sums i = k (mod 2), so each row keeps four independent FMA
 * chains (an FMA waits ~4 cycles for the one before it on the same register) and the order of every sum is the
 * same for any `rows`: that is the batch invariance. */
ORD_INLINE void matmul_tile(const float *x, int64_t in, const void *panel, const float *bias, float *y,
                            int64_t ldy, int64_t width, const int rows, const int bf16) {
    v16 acc[2][TILE_ROWS][2];
    const v16 zero = {0};
    for (int k = 0; k < 2; ++k) {
        for (int r = 0; r < rows; ++r) {
            acc[k][r][0] = zero;
            acc[k][r][1] = zero;
        }
    }
    int64_t i = 0;
    for (; i + 2 <= in; i += 2) {
        for (int k = 0; k < 2; ++k) {
            v16 w0, w1;
            panel_row(panel, i + k, bf16, &w0, &w1);
            for (int r = 0; r < rows; ++r) {
                const float xi = x[r * in + i + k];
                acc[k][r][0] += xi * w0;
                acc[k][r][1] += xi * w1;
            }
        }
    }
    if (i < in) {
        v16 w0, w1;
        panel_row(panel, i, bf16, &w0, &w1);
        for (int r = 0; r < rows; ++r) {
            acc[0][r][0] += x[r * in + i] * w0;
            acc[0][r][1] += x[r * in + i] * w1;
        }
    }
    for (int r = 0; r < rows; ++r) {
        v16 lo = acc[0][r][0] + acc[1][r][0], hi = acc[0][r][1] + acc[1][r][1];
        if (bias != NULL) {
            lo += *(const v16u *)bias;
            hi += *(const v16u *)(bias + 16);
        }
        if (width == PANEL) {
            *(v16u *)(y + r * ldy) = lo;
            *(v16u *)(y + r * ldy + 16) = hi;
        } else {
            float lanes[PANEL];
            *(v16u *)lanes = lo;
            *(v16u *)(lanes + 16) = hi;
            for (int64_t j = 0; j < width; ++j) y[r * ldy + j] = lanes[j];
        }
    }
}

/* Work items [first, last) of the product: item t is panel t / blocks, rows (t % blocks) * TILE_ROWS onwards, so
 * consecutive items of one thread reuse the panel while it is in cache. Each item writes its own part of y. */
ORD_INLINE void matmul_items(const float *x, int64_t n, int64_t in, const void *panels, int64_t out,
                             const float *bias, float *y, const int bf16, int64_t first, int64_t last) {
    const size_t element = bf16 ? sizeof(uint16_t) : sizeof(float);
    const int64_t blocks = (n + TILE_ROWS - 1) / TILE_ROWS;
    for (int64_t t = first; t < last; ++t) {
        const int64_t p = t / blocks, r = (t % blocks) * TILE_ROWS;
        const int64_t o0 = p * PANEL;
        const void *panel = (const char *)panels + (size_t)(o0 * in) * element;
        const float *b = bias != NULL ? bias + o0 : NULL;
        const int64_t width = out - o0 < PANEL ? out - o0 : PANEL;
        const float *xr = x + r * in;
        float *yr = y + r * out + o0;
        /* Constant row counts, so each tile's loops unroll and its accumulators stay in registers. */
        switch (n - r < TILE_ROWS ? n - r : TILE_ROWS) {
            case 6: matmul_tile(xr, in, panel, b, yr, out, width, 6, bf16); break;
            case 5: matmul_tile(xr, in, panel, b, yr, out, width, 5, bf16); break;
            case 4: matmul_tile(xr, in, panel, b, yr, out, width, 4, bf16); break;
            case 3: matmul_tile(xr, in, panel, b, yr, out, width, 3, bf16); break;
            case 2: matmul_tile(xr, in, panel, b, yr, out, width, 2, bf16); break;
            default: matmul_tile(xr, in, panel, b, yr, out, width, 1, bf16); break;
        }
    }
}

ORD_CLONES
static void matmul_span(const float *x, int64_t n, int64_t in, const void *panels, int64_t out, const float *bias,
                        float *y, int bf16, int64_t first, int64_t last) {
    if (bf16)
        matmul_items(x, n, in, panels, out, bias, y, 1, first, last);
    else
        matmul_items(x, n, in, panels, out, bias, y, 0, first, last);
}

/* A matmul of fewer multiply-adds than this runs on one thread: a parallel region costs a few microseconds. */
enum { PARALLEL_MACS = 1 << 20 };

/* y [n, out] = x [n, in] @ W (+ bias), W in panels. The items split over the threads (the same sums per output
 * whatever the count). The parallel region is here, outside the target_clones variants: a region's outlined body
 * would be compiled for the baseline ISA. */
static void matmul(const float *x, int64_t n, int64_t in, const void *panels, int64_t out, const float *bias,
                   float *y, int bf16, int threads) {
    const int64_t count = (out + PANEL - 1) / PANEL * ((n + TILE_ROWS - 1) / TILE_ROWS);
    if (threads <= 1 || n * in * out < PARALLEL_MACS) {
        matmul_span(x, n, in, panels, out, bias, y, bf16, 0, count);
        return;
    }
#pragma omp parallel num_threads(threads)
    {
        const int64_t t = omp_get_thread_num(), nt = omp_get_num_threads();
        matmul_span(x, n, in, panels, out, bias, y, bf16, count * t / nt, count * (t + 1) / nt);
    }
}

/* The linear layer's entry point (engine/model/native.py PanelLinearKernel, which checks every shape first):
 * x [n, in] float32, panels [ceil(out / 32), in, 32] float32 (bf16 != 0: bf16), bias NULL or [ceil(out / 32) * 32]
 * float32, y [n, out] float32, all contiguous. */
void ordinal_panel_linear(const float *x, int64_t n, int64_t in, const void *panels, int64_t out, const float *bias,
                          float *y, int bf16, int threads) {
    if (n > 0 && out > 0) matmul(x, n, in, panels, out, bias, y, bf16, threads);
}
