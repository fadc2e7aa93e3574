/* Paged decode attention on CPU: keys and values read in place from the pool, one query token per sequence or a
 * short run of them (a speculative verify's chain: query j of a run sees one key more than query j - 1).
 *
 * Built by engine/model/native.py with `cc -O3 -fopenmp -fPIC -shared` (no -march: the compiled library may
 * be shared between machines). On x86-64 the workers are compiled several times with target_clones and the
 * loader picks the widest variant the CPU supports, so AVX2+FMA / AVX-512 are used where present without making
 * the library unportable. No -ffast-math: the `omp simd` pragmas are what allow the sums to be reassociated
 * into vector lanes.
 *
 * Layouts (all contiguous):
 *   q, out         [B, H, D]          float32
 *   k_pool, v_pool [slots, Hkv, D]    float32, slot = page * page_size + offset
 *   page_tables    [B, P]             int64, pages of query b's sequence in position order
 *   kv_lens        [B]                int64, keys of query b (it sits at position kv_lens[b] - 1)
 *   runs           [S + 1]            int64 or NULL: the queries of sequence s are rows runs[s] .. runs[s + 1] - 1,
 *                                     which share a page table (NULL: every query its own sequence)
 * Query head h reads kv head h / (H / Hkv), like transformers' repeat_kv.
 *
 * Two workers. A single query (a decode) takes `attend`: each key row is read once for the query heads of its kv
 * heads, a dot product a head. A run of queries takes `attend_lanes`, whose vector lanes are the run's rows (query
 * j, query head g of one kv head): a key is read once for all of them and no score needs a horizontal sum. At a
 * verify of seven queries over 64-128 keys (head_dim 32, 2 query heads a kv head) that is 2-2.5 times faster than
 * seven single queries; for one query, whose two rows would leave fourteen lanes idle, it is slower. Both add in
 * one order (canonical_dot, key_order_sum, the value sums in key order), so a query's output is the same bits
 * whichever worker computes it: a verify's node gets the logits a decode of its token gets, and a greedy verify
 * accepts exactly what plain greedy decoding writes.
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

/* q . k in the one order both workers use: element d into part d % 8 (in order of d), then the parts added
 * pairwise, halving: 4, 2, 1. One order for both keeps a verify's node bit for bit equal to a decode of its token;
 * eight parts keep a single query's dot product a vector wide and a run's eight accumulators a key in registers. */
ORD_INLINE float canonical_dot(const float *q, const float *k, const int64_t dim) {
    float part[8] = {0};
    if (dim % 8 == 0) {
        for (int64_t d0 = 0; d0 < dim; d0 += 8) {
#pragma omp simd
            for (int64_t m = 0; m < 8; ++m) part[m] += q[d0 + m] * k[d0 + m];
        }
    } else {
        for (int64_t d = 0; d < dim; ++d) part[d % 8] += q[d] * k[d];
    }
    for (int64_t half = 4; half >= 1; half /= 2)
        for (int64_t m = 0; m < half; ++m) part[m] += part[m + half];
    return part[0];
}

/* The sum of x[0 .. n) (the numerators of keys first .. first + n - 1) in the order attend_lanes sums them: key t
 * into part t % 16 in key order, then the parts 0 .. 15 in turn. One order for both workers keeps a verify's node
 * bit for bit equal to a decode of its token, and sixteen parts keep the loop vectorized. */
ORD_INLINE float key_order_sum(const float *x, int64_t first, int64_t n) {
    float part[16] = {0};
    int64_t j = 0;
    for (; j < n && (first + j) % 16 != 0; ++j) part[(first + j) % 16] += x[j];
    for (; j + 16 <= n; j += 16) {
#pragma omp simd
        for (int64_t r = 0; r < 16; ++r) part[r] += x[j + r];
    }
    for (; j < n; ++j) part[(first + j) % 16] += x[j];
    float sum = 0.0f;
    for (int64_t r = 0; r < 16; ++r) sum += part[r];
    return sum;
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
            for (int64_t i = 0; i < nq; ++i)
                s[i * n + r] = canonical_dot(q_scaled + i * dim, k_row + kv_of[i] * dim, dim);
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
#pragma omp simd
        for (int64_t j = 0; j < n; ++j) s[j] = exp_nonpositive(s[j] - max);
        const float sum = key_order_sum(s, first, n);
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

/* A run of queries of one sequence (a verify's chain), one kv head `kvh`: its rows row0 .. row0 + nrows - 1 (row
 * j * G + g is query j's query head g of the kv head), up to ORD_LANES of them, are the lanes of every vector, so
 * that each key is read once for all of them: a key's scores are `dim` multiply-adds of the transposed queries by
 * the key's elements (in canonical_dot's parts, added pairwise lane by lane), its softmax a lane-wise max and exp,
 * its values `dim` multiply-adds of the lanes' probabilities. Query j sees the keys [first_j, lens[j]) (a chain's later
 * queries one key more each); key positions are compared as floats, exact below 2^24. q and out point at query 0's
 * row (rows q_stride floats apart). scratch: [ORD_LANES * (keys spanned + 2 * dim + 4)]. dim is a multiple of 8. */
#define ORD_LANES 16
ORD_INLINE void attend_lanes_dim(const PagedDecodeArgs *a, const int64_t *pages, const int64_t *lens, int64_t kvh,
                                 int64_t row0, int64_t nrows, const float *q, float *out, int64_t q_stride,
                                 float *scratch, const int64_t dim) {
    const int64_t group = a->heads / a->kv_heads;
    const int64_t row_stride = a->kv_heads * dim;
    const int64_t page_size = a->page_size;
    float *qt = scratch;                     /* [dim][LANES] scaled queries, transposed */
    float *acc = qt + dim * ORD_LANES;       /* [dim][LANES] */
    float *mx = acc + dim * ORD_LANES;       /* [LANES] */
    float *sum = mx + ORD_LANES;             /* [LANES] */
    float *lo_l = sum + ORD_LANES;           /* [LANES] first key of each lane, as float for the compare */
    float *hi_l = lo_l + ORD_LANES;          /* [LANES] one past its last */
    float *p = hi_l + ORD_LANES;             /* [span][LANES] */
    int64_t lo = INT64_MAX, hi = 0;
    for (int64_t l = 0; l < ORD_LANES; ++l) {
        lo_l[l] = 0.0f;
        hi_l[l] = 0.0f; /* an unused lane sees no key */
        mx[l] = -INFINITY;
        sum[l] = 0.0f;
    }
    for (int64_t l = 0; l < nrows; ++l) {
        const int64_t row = row0 + l, j = row / group, head = kvh * group + row % group;
        const int64_t len = lens[j];
        const int64_t first = (a->window > 0 && len > a->window) ? len - a->window : 0;
        lo = first < lo ? first : lo;
        hi = len > hi ? len : hi;
        lo_l[l] = (float)first;
        hi_l[l] = (float)len;
        const float *qi = q + j * q_stride + head * dim;
        for (int64_t d = 0; d < dim; ++d) qt[d * ORD_LANES + l] = qi[d] * a->scale;
    }
    for (int64_t l = nrows; l < ORD_LANES; ++l)
        for (int64_t d = 0; d < dim; ++d) qt[d * ORD_LANES + l] = 0.0f;
    float poison[ORD_LANES] = {0}; /* NaN where a visible score is NaN or infinite, which the clamped exp would hide */

    /* Pass 1: every key's scores for all lanes, each in canonical_dot's order, two keys at a time (sixteen
     * independent chains of multiply-adds), masked to each lane's keys; the lane-wise running max. */
    for (int64_t t = lo; t < hi;) {
        const int64_t offset = t % page_size;
        const int64_t run = (page_size - offset < hi - t) ? page_size - offset : hi - t;
        const float *k_row = a->k_pool + (pages[t / page_size] * page_size + offset) * row_stride + kvh * dim;
        for (int64_t r = 0; r < run; r += 2) {
            const float *k0 = k_row + r * row_stride;
            const float *k1 = k0 + (r + 1 < run ? row_stride : 0);
            float u[8][ORD_LANES] = {{0}}, w[8][ORD_LANES] = {{0}};
            for (int64_t d0 = 0; d0 < dim; d0 += 8) {
                for (int64_t m = 0; m < 8; ++m) {
                    const float x0 = k0[d0 + m], x1 = k1[d0 + m];
                    const float *qd = qt + (d0 + m) * ORD_LANES;
#pragma omp simd
                    for (int64_t l = 0; l < ORD_LANES; ++l) {
                        u[m][l] += qd[l] * x0;
                        w[m][l] += qd[l] * x1;
                    }
                }
            }
            for (int64_t half = 4; half >= 1; half /= 2)
                for (int64_t m = 0; m < half; ++m)
#pragma omp simd
                    for (int64_t l = 0; l < ORD_LANES; ++l) {
                        u[m][l] += u[m + half][l];
                        w[m][l] += w[m + half][l];
                    }
            for (int64_t i = 0; i < 2 && r + i < run; ++i) {
                const float *dot = i == 0 ? u[0] : w[0];
                float *s = p + (t + r + i - lo) * ORD_LANES;
                const float key = (float)(t + r + i);
#pragma omp simd
                for (int64_t l = 0; l < ORD_LANES; ++l) {
                    const int seen = key >= lo_l[l] && key < hi_l[l];
                    poison[l] += seen ? dot[l] * 0.0f : 0.0f;
                    s[l] = seen ? dot[l] : -INFINITY;
                    mx[l] = s[l] > mx[l] ? s[l] : mx[l];
                }
            }
        }
        t += run;
    }
    /* Softmax numerators (0 for a key the lane does not see), summed as key_order_sum does (key t into part t % 16,
     * then the parts in turn: adding a 0 changes no sum); 1 / sum is applied at the end. */
    float parts[16][ORD_LANES];
    for (int64_t m = 0; m < 16; ++m)
        for (int64_t l = 0; l < ORD_LANES; ++l) parts[m][l] = 0.0f;
    for (int64_t t = 0; t < hi - lo; ++t) {
        float *s = p + t * ORD_LANES;
        float *part = parts[(t + lo) % 16];
        const float key = (float)(t + lo);
#pragma omp simd
        for (int64_t l = 0; l < ORD_LANES; ++l) {
            const int seen = key >= lo_l[l] && key < hi_l[l];
            const float e = exp_nonpositive(seen ? s[l] - mx[l] : 0.0f);
            s[l] = seen ? e : 0.0f;
            part[l] += s[l];
        }
    }
    for (int64_t m = 0; m < 16; ++m)
        for (int64_t l = 0; l < ORD_LANES; ++l) sum[l] += parts[m][l];
    /* Pass 2: acc[d][lane] = sum_t p[t][lane] * v_t[d], eight elements of d at a time: eight accumulators stay in
     * registers over every key. */
    for (int64_t d0 = 0; d0 < dim; d0 += 8) {
        float a0[ORD_LANES] = {0}, a1[ORD_LANES] = {0}, a2[ORD_LANES] = {0}, a3[ORD_LANES] = {0};
        float a4[ORD_LANES] = {0}, a5[ORD_LANES] = {0}, a6[ORD_LANES] = {0}, a7[ORD_LANES] = {0};
        for (int64_t t = lo; t < hi;) {
            const int64_t offset = t % page_size;
            const int64_t run = (page_size - offset < hi - t) ? page_size - offset : hi - t;
            const float *v = a->v_pool + (pages[t / page_size] * page_size + offset) * row_stride + kvh * dim + d0;
            const float *pt = p + (t - lo) * ORD_LANES;
            for (int64_t r = 0; r < run; ++r, v += row_stride, pt += ORD_LANES) {
                const float v0 = v[0], v1 = v[1], v2 = v[2], v3 = v[3], v4 = v[4], v5 = v[5], v6 = v[6], v7 = v[7];
#pragma omp simd
                for (int64_t l = 0; l < ORD_LANES; ++l) {
                    const float pl = pt[l];
                    a0[l] += pl * v0;
                    a1[l] += pl * v1;
                    a2[l] += pl * v2;
                    a3[l] += pl * v3;
                    a4[l] += pl * v4;
                    a5[l] += pl * v5;
                    a6[l] += pl * v6;
                    a7[l] += pl * v7;
                }
            }
            t += run;
        }
        float *const rows8[8] = {a0, a1, a2, a3, a4, a5, a6, a7};
        for (int64_t i = 0; i < 8; ++i)
            for (int64_t l = 0; l < ORD_LANES; ++l) acc[(d0 + i) * ORD_LANES + l] = rows8[i][l];
    }
    for (int64_t l = 0; l < nrows; ++l) {
        const int64_t row = row0 + l, j = row / group, head = kvh * group + row % group;
        const float inv = poison[l] == 0.0f ? 1.0f / sum[l] : NAN;
        float *o = out + j * q_stride + head * dim;
        for (int64_t d = 0; d < dim; ++d) o[d] = acc[d * ORD_LANES + l] * inv;
    }
}

ORD_CLONES
static void attend_lanes(const PagedDecodeArgs *a, const int64_t *pages, const int64_t *lens, int64_t kvh,
                         int64_t row0, int64_t nrows, int64_t dim, const float *q, float *out, int64_t q_stride,
                         float *scratch) {
    switch (dim) {
        case 64: attend_lanes_dim(a, pages, lens, kvh, row0, nrows, q, out, q_stride, scratch, 64); break;
        case 128: attend_lanes_dim(a, pages, lens, kvh, row0, nrows, q, out, q_stride, scratch, 128); break;
        case 32: attend_lanes_dim(a, pages, lens, kvh, row0, nrows, q, out, q_stride, scratch, 32); break;
        default: attend_lanes_dim(a, pages, lens, kvh, row0, nrows, q, out, q_stride, scratch, dim); break;
    }
}

/* A run takes the lanes worker where its rows fill enough lanes to pay (and pass 2's chunks of eight fit). */
static int use_lanes(int64_t count, int64_t group, int64_t head_dim) {
    return count >= 2 && count * group >= 6 && head_dim % 8 == 0;
}

/* Returns 0 on success, 1 when scratch memory could not be allocated (out is then incomplete). */
int ordinal_paged_decode(const float *q, const float *k_pool, const float *v_pool, const int64_t *page_tables,
                         const int64_t *kv_lens, float *out, int64_t batch, int64_t heads, int64_t kv_heads,
                         int64_t head_dim, int64_t num_pages_per_seq, int64_t page_size, int64_t window,
                         float scale, int num_threads, const int64_t *runs, int64_t num_runs) {
    const PagedDecodeArgs args = {k_pool, v_pool, page_tables, kv_lens, num_pages_per_seq,
                                  page_size, heads, kv_heads, window, scale};
    const int64_t group = heads / kv_heads;
    if (num_threads < 1) num_threads = 1;
    if (runs == NULL) num_runs = batch;
    int64_t max_keys = num_pages_per_seq * page_size;
    if (window > 0 && window < max_keys) max_keys = window;
    /* Work items are (sequence, block of kv heads). Whole rows (all kv heads) make each page one contiguous
     * read, which is the faster memory pattern; with few sequences per thread, split by kv head instead so
     * every thread has work. */
    const int64_t kv_block = num_runs >= 4 * (int64_t)num_threads ? kv_heads : 1;
    const int64_t blocks = kv_heads / kv_block;
    const int64_t nq = kv_block * group;
    /* The lanes worker's keys span a run's first query's window to its last query's key: at most max_keys. */
    const int64_t lanes_scratch = ORD_LANES * (num_pages_per_seq * page_size + 2 * head_dim + 4);
    const int64_t row_scratch = nq * (max_keys + 2 * head_dim);
    const int64_t scratch_floats = lanes_scratch > row_scratch ? lanes_scratch : row_scratch;
    int failed = 0;

#pragma omp parallel num_threads(num_threads) if (num_threads > 1 && num_runs * blocks > 1) reduction(| : failed)
    {
        float *scratch = malloc(sizeof(float) * (size_t)scratch_floats);
        if (scratch == NULL) failed = 1;
        /* Lengths differ a lot between sequences: hand out items one at a time. */
#pragma omp for collapse(2) schedule(dynamic, 1)
        for (int64_t s = 0; s < num_runs; ++s) {
            for (int64_t blk = 0; blk < blocks; ++blk) {
                if (scratch == NULL) continue;
                const int64_t first = runs == NULL ? s : runs[s];
                const int64_t count = runs == NULL ? 1 : runs[s + 1] - runs[s];
                if (!use_lanes(count, group, head_dim)) {
                    for (int64_t b = first; b < first + count; ++b) {
                        const int64_t offset = (b * heads + blk * nq) * head_dim;
                        float *q_scaled = scratch + nq * max_keys;
                        attend(&args, b, blk * kv_block, kv_block, head_dim, q + offset, out + offset, scratch,
                               q_scaled, q_scaled + nq * head_dim);
                    }
                    continue;
                }
                const int64_t rows = count * group, offset = first * heads * head_dim;
                for (int64_t kvh = blk * kv_block; kvh < (blk + 1) * kv_block; ++kvh)
                    for (int64_t row0 = 0; row0 < rows; row0 += ORD_LANES)
                        attend_lanes(&args, page_tables + first * num_pages_per_seq, kv_lens + first, kvh, row0,
                                     rows - row0 < ORD_LANES ? rows - row0 : ORD_LANES, head_dim, q + offset,
                                     out + offset, heads * head_dim, scratch);
            }
        }
        free(scratch);
    }
    return failed;
}
