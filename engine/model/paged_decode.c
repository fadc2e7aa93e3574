/* Paged decode attention on CPU: one query token per sequence, keys and values read in place from the pool.
 *
 * Built by engine/model/native.py with `cc -O3 -fopenmp -fPIC -shared` (no -march: the compiled library may
 * be shared between machines). On x86-64 the worker for one (sequence, kv heads) item is compiled several times
 * with target_clones and the loader picks the widest variant the CPU supports, so AVX2+FMA / AVX-512 are used
 * where present without making the library unportable. No -ffast-math: the `omp simd reduction` pragmas are
 * what allow the dot products and sums to be reassociated into vector lanes.
 *
 * Layouts (all contiguous):
 *   q, out         [B, H, D]          float32
 *   k_pool, v_pool [slots, Hkv, D]    float32, slot = page * page_size + offset
 *   page_tables    [B, P]             int64, pages of sequence b in position order
 *   kv_lens        [B]                int64, keys of sequence b (its query sits at position kv_lens[b] - 1)
 * Query head h reads kv head h / (H / Hkv), like transformers' repeat_kv.
 */

#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define ORD_CLONES __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#else
#define ORD_CLONES
#endif
#define ORD_INLINE static inline __attribute__((always_inline))

typedef struct {
    const float *k_pool;
    const float *v_pool;
    const int64_t *page_tables;
    const int64_t *kv_lens;
    int64_t num_pages_per_seq; /* P */
    int64_t page_size;
    int64_t heads;
    int64_t kv_heads;
    int64_t window; /* 0 = full causal */
    float scale;
} PagedDecodeArgs;

/* exp(x) for x <= 0 (a score minus its row max), within ~1e-7 relative. glibc's expf is a scalar call that
 * stops the loop from vectorizing and dominated the kernel's time; this one vectorizes (Cephes-style
 * range reduction exp(x) = 2^n * exp(r), |r| <= ln2 / 2, and a degree-6 polynomial). Below -87 the result
 * is clamped to ~1.6e-38, which is 0 next to the row's largest term 1. The clamp compares bit patterns
 * because fmaxf and float selects keep GCC from vectorizing the loop without -ffast-math; for x <= 0 a
 * larger magnitude is a larger unsigned pattern. */
ORD_INLINE float exp_nonpositive(float x) {
    union {
        float f;
        uint32_t u;
    } clamped = {.f = x};
    clamped.u = clamped.u < 0xC2AE0000u ? clamped.u : 0xC2AE0000u; /* 0xC2AE0000 is -87.0f */
    x = clamped.f;
    const float shifter = 12582912.0f; /* 1.5 * 2^23: adding then subtracting it rounds to an integer */
    const float n = (x * 1.44269504088896341f + shifter) - shifter;
    const float r = (x - n * 0.693359375f) + n * 2.12194440e-4f; /* x - n * ln2, ln2 split in two parts */
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    union {
        int32_t i;
        float f;
    } two_n = {.i = ((int32_t)n + 127) << 23};
    return p * two_n.f;
}

/* Pages are scattered over the pool, so the hardware prefetcher cannot follow the jump from one page to the
 * next: while row r of a page is computed, ask for row r of the next page (`width` floats of it). */
ORD_INLINE void prefetch_row(const float *row, int64_t width) {
    for (int64_t x = 0; x < width; x += 16) __builtin_prefetch(row + x, 0, 3);
}

/* Sequence b, kv heads [kvh0, kvh0 + kv_count): the kv_count * G query heads involved are contiguous in q and
 * out (q and out point at the first one). Each key and value row is read once for its G query heads, and
 * with several kv heads per call a page is read as one contiguous block. `dim` is a compile-time constant
 * at the hot call sites, so the loops over it unroll and keep their accumulators in registers.
 * scores: scratch [kv_count * G, max keys]; q_scaled, acc: scratch [kv_count * G, D]. */
ORD_INLINE void attend_dim(const PagedDecodeArgs *a, int64_t b, int64_t kvh0, int64_t kv_count, const float *q,
                           float *out, float *scores, float *q_scaled, float *acc, const int64_t dim) {
    const int64_t group = a->heads / a->kv_heads;
    const int64_t nq = kv_count * group; /* query heads handled here */
    const int64_t row_stride = a->kv_heads * dim;
    const int64_t page_size = a->page_size;
    const int64_t len = a->kv_lens[b];
    /* HF sliding window: the query at position len - 1 sees key k iff (len - 1) - k < window. */
    const int64_t first = (a->window > 0 && len > a->window) ? len - a->window : 0;
    const int64_t n = len - first;
    const int64_t *pages = a->page_tables + b * a->num_pages_per_seq;
    const int64_t num_pages = (len + page_size - 1) / page_size;
    const int64_t width = kv_count * dim; /* floats of a row read here */
    const float *k_base = a->k_pool + kvh0 * dim;
    const float *v_base = a->v_pool + kvh0 * dim;

    if (n <= 0) {
        for (int64_t i = 0; i < nq * dim; ++i) out[i] = 0.0f;
        return;
    }
    for (int64_t i = 0; i < nq * dim; ++i) q_scaled[i] = q[i] * a->scale;
    int64_t kv_of[nq]; /* kv head (relative to kvh0) of each query head, without a division per key */
    for (int64_t i = 0; i < nq; ++i) kv_of[i] = i / group;

    /* Pass 1: scores[i, t] = (q_i * scale) . k_t, a page (a contiguous run of slots) at a time. */
    for (int64_t t = first; t < len;) {
        const int64_t offset = t % page_size;
        const int64_t run = (page_size - offset < len - t) ? page_size - offset : len - t;
        const float *k_row = k_base + (pages[t / page_size] * page_size + offset) * row_stride;
        const int64_t next_page = t / page_size + 1 < num_pages ? pages[t / page_size + 1] : pages[t / page_size];
        const float *k_next = k_base + next_page * page_size * row_stride;
        float *s = scores + (t - first);
        for (int64_t r = 0; r < run; ++r, k_row += row_stride) {
            prefetch_row(k_next + r * row_stride, width);
            for (int64_t i = 0; i < nq; ++i) {
                const float *qi = q_scaled + i * dim;
                const float *k = k_row + kv_of[i] * dim;
                float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
                for (int64_t d = 0; d < dim; ++d) dot += qi[d] * k[d];
                s[i * n + r] = dot;
            }
        }
        t += run;
    }

    /* Softmax numerators per query head; 1 / sum is applied to the accumulated output at the end. */
    for (int64_t i = 0; i < nq; ++i) {
        float *s = scores + i * n;
        float max = s[0];
        float poison = 0.0f; /* becomes NaN if any score is NaN or infinite, which the clamped exp would hide */
#pragma omp simd reduction(max : max) reduction(+ : poison)
        for (int64_t j = 0; j < n; ++j) {
            max = s[j] > max ? s[j] : max;
            poison += s[j] * 0.0f;
        }
        float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
        for (int64_t j = 0; j < n; ++j) {
            s[j] = exp_nonpositive(s[j] - max);
            sum += s[j];
        }
        q_scaled[i] = poison == 0.0f ? 1.0f / sum : NAN; /* q is no longer needed: reuse it for 1 / sum */
    }

    /* Pass 2: acc[i] = sum_t p[i, t] * v_t, again a page at a time. */
    for (int64_t i = 0; i < nq * dim; ++i) acc[i] = 0.0f;
    for (int64_t t = first; t < len;) {
        const int64_t offset = t % page_size;
        const int64_t run = (page_size - offset < len - t) ? page_size - offset : len - t;
        const float *v_row = v_base + (pages[t / page_size] * page_size + offset) * row_stride;
        const int64_t next_page = t / page_size + 1 < num_pages ? pages[t / page_size + 1] : pages[t / page_size];
        const float *v_next = v_base + next_page * page_size * row_stride;
        const float *s = scores + (t - first);
        for (int64_t r = 0; r < run; ++r, v_row += row_stride) {
            prefetch_row(v_next + r * row_stride, width);
            for (int64_t i = 0; i < nq; ++i) {
                const float p = s[i * n + r];
                const float *v = v_row + kv_of[i] * dim;
                float *acc_i = acc + i * dim;
#pragma omp simd
                for (int64_t d = 0; d < dim; ++d) acc_i[d] += p * v[d];
            }
        }
        t += run;
    }
    for (int64_t i = 0; i < nq; ++i) {
        const float inv = q_scaled[i];
#pragma omp simd
        for (int64_t d = 0; d < dim; ++d) out[i * dim + d] = acc[i * dim + d] * inv;
    }
}

ORD_CLONES
static void attend(const PagedDecodeArgs *a, int64_t b, int64_t kvh0, int64_t kv_count, int64_t dim, const float *q,
                   float *out, float *scores, float *q_scaled, float *acc) {
    switch (dim) {
        case 64: attend_dim(a, b, kvh0, kv_count, q, out, scores, q_scaled, acc, 64); break;
        case 128: attend_dim(a, b, kvh0, kv_count, q, out, scores, q_scaled, acc, 128); break;
        case 32: attend_dim(a, b, kvh0, kv_count, q, out, scores, q_scaled, acc, 32); break;
        default: attend_dim(a, b, kvh0, kv_count, q, out, scores, q_scaled, acc, dim); break;
    }
}

/* Returns 0 on success, 1 when scratch memory could not be allocated (out is then incomplete). */
int ordinal_paged_decode(const float *q, const float *k_pool, const float *v_pool, const int64_t *page_tables,
                         const int64_t *kv_lens, float *out, int64_t batch, int64_t heads, int64_t kv_heads,
                         int64_t head_dim, int64_t num_pages_per_seq, int64_t page_size, int64_t window,
                         float scale, int num_threads) {
    const PagedDecodeArgs args = {k_pool, v_pool, page_tables, kv_lens, num_pages_per_seq,
                                  page_size, heads, kv_heads, window, scale};
    const int64_t group = heads / kv_heads;
    if (num_threads < 1) num_threads = 1;
    int64_t max_keys = num_pages_per_seq * page_size;
    if (window > 0 && window < max_keys) max_keys = window;
    /* Work items are (sequence, block of kv heads). Whole rows (all kv heads) make each page one contiguous
     * read, which is the faster memory pattern; with few sequences per thread, split by kv head instead so
     * every thread has work. */
    const int64_t kv_block = batch >= 4 * (int64_t)num_threads ? kv_heads : 1;
    const int64_t blocks = kv_heads / kv_block;
    const int64_t nq = kv_block * group;
    int failed = 0;

#pragma omp parallel num_threads(num_threads) if (num_threads > 1 && batch * blocks > 1) reduction(| : failed)
    {
        float *scratch = malloc(sizeof(float) * (size_t)(nq * (max_keys + 2 * head_dim)));
        if (scratch == NULL) failed = 1;
        /* Lengths differ a lot between sequences: hand out items one at a time. */
#pragma omp for collapse(2) schedule(dynamic, 1)
        for (int64_t b = 0; b < batch; ++b) {
            for (int64_t blk = 0; blk < blocks; ++blk) {
                if (scratch == NULL) continue;
                const int64_t offset = (b * heads + blk * nq) * head_dim;
                float *q_scaled = scratch + nq * max_keys;
                attend(&args, b, blk * kv_block, kv_block, head_dim, q + offset, out + offset, scratch, q_scaled,
                       q_scaled + nq * head_dim);
            }
        }
        free(scratch);
    }
    return failed;
}
