/* Greedy draft chains on CPU: a small Llama-family draft model's whole multi-step decode in one call.
 *
 * Why: a draft model's forward at a handful of rows is almost all fixed cost on a CPU (a 2-layer, 128-wide draft
 * does ~0.7 M multiply-adds per token, which takes ~20 us, while its eager torch forward takes ~0.5 ms of op
 * dispatch), and a chain of depth k is k such forwards plus the Python between them. Here the k forwards, the
 * argmax between them and the draft KV writes are one C call that releases the GIL: the CPU counterpart of running
 * the draft's multi-step loop as one captured CUDA graph. Only greedy chains come here (an argmax spine, no
 * siblings, no grammar masks); the proposer keeps every other draft on the torch path.
 *
 * Built by engine/model/native.py like paged_decode.c, whose attention worker it includes (the library's cache
 * name hashes both sources). Arithmetic follows engine/model/llama.py op for op (RMSNorm, half-split RoPE from the
 * model's own cos/sin tables, SwiGLU, the same paged attention); sums run in another order than torch's, so logits
 * agree to rounding, not bit for bit, which a draft may do: the verify decides what is committed.
 *
 * Layouts (all contiguous float32 unless said):
 *   embed      [V_model, hidden]       lm_head [V_model over hidden, in panels]  final_norm [hidden]
 *   cos, sin   [max_positions, D/2]
 *   every matrix "out over in" is in panels (see matmul), its bias padded like it
 *   per layer (an int64 row of LAYER_FIELDS addresses, 0 = absent):
 *     in_norm [hidden], qkv [q_dim + 2 kv_dim over hidden] (q | k | v), qkv_bias, q_norm [D], k_norm [D],
 *     o [hidden over q_dim], o_bias, post_norm [hidden], gate_up [2 inter over hidden] (gate | up), gate_up_bias,
 *     down [hidden over inter], down_bias, k_pool, v_pool [slots, Hkv, D], then the layer's sliding window (0: none)
 *   feed_tokens [sum of feeds] int64, feed_offsets [B + 1] int64: row b feeds feed_tokens[off[b] .. off[b + 1])
 *     at positions start_pos[b] ..; page_tables [B, P] int64; depths [B] int64 (>= 1)
 *   out_tokens [B, max_depth] int64: row b's chain in out_tokens[b, 0 .. out_lengths[b]); out_lengths [B] int64;
 *     out_logits, when not NULL, [B, max_depth, vocab]: the logits each chain token was chosen from (tests compare
 *     them with torch's).
 * min_prob: a chain ends after its first token whose softmax probability is below it (the draft unsure there: the
 *   tokens after it would rarely be accepted, and each costs a verify row); 0 drafts every row to its depth.
 * Up to max_depth forwards: the first runs every row's feed tokens (a catch-up is one batched forward, like a prefill
 * chunk), each later one every unfinished chain's last token; each token's KV is written at its position before its
 * attention reads the row's keys.
 */

#include "paged_decode.c"

#include <omp.h>

enum {
    L_IN_NORM,
    L_QKV,
    L_QKV_BIAS,
    L_Q_NORM,
    L_K_NORM,
    L_O,
    L_O_BIAS,
    L_POST_NORM,
    L_GATE_UP,
    L_GATE_UP_BIAS,
    L_DOWN,
    L_DOWN_BIAS,
    L_K_POOL,
    L_V_POOL,
    L_WINDOW,
    LAYER_FIELDS
};

typedef struct {
    int64_t hidden, inter, heads, kv_heads, head_dim, num_layers, model_vocab, vocab, page_size, pages_per_seq;
    int bf16;    /* the matrices' panels hold bf16 values */
    int threads; /* OpenMP threads for the large matmuls and the attention of many rows */
    float eps;
    const float *embed, *final_norm, *cos, *sin;
    const void *lm_head; /* panels */
    const int64_t *layers; /* [num_layers, LAYER_FIELDS] */
} Model;

#define FIELD(m, layer, f) ((float *)(intptr_t)(m)->layers[(layer) * LAYER_FIELDS + (f)])

/* The matrix products (weights in 32-column panels, tiles of rows streaming each panel once in address order, the
 * same sums per row whatever the batch): panel_matmul.c, shared with the target's linear layers. */
#include "panel_matmul.c"

/* out = x * rsqrt(mean(x^2) + eps) * weight over `dim` (F.rms_norm's arithmetic in float32); out may be x. */
ORD_CLONES
static void rms_norm(const float *x, const float *weight, int64_t dim, float eps, float *out) {
    float sq = 0.0f;
#pragma omp simd reduction(+ : sq)
    for (int64_t i = 0; i < dim; ++i) sq += x[i] * x[i];
    const float inv = 1.0f / sqrtf(sq / (float)dim + eps);
#pragma omp simd
    for (int64_t i = 0; i < dim; ++i) out[i] = x[i] * inv * weight[i];
}

/* Half-split rotary embedding of `count` heads of `dim` at one position, in place (apply_rope in llama.py). */
static void rope(float *x, int64_t count, int64_t dim, const float *cos, const float *sin) {
    const int64_t half = dim / 2;
    for (int64_t h = 0; h < count; ++h) {
        float *x1 = x + h * dim, *x2 = x1 + half;
        for (int64_t i = 0; i < half; ++i) {
            const float a = x1[i], b = x2[i];
            x1[i] = a * cos[i] - b * sin[i];
            x2[i] = b * cos[i] + a * sin[i];
        }
    }
}

typedef struct {
    float *h, *xn, *qkv, *attn, *gate_up, *act, *delta, *logits, *attend_scratch;
} Scratch;

/* One forward of n rows, token tok[r] at position pos[r] of batch row row[r]: the residual stream ends in s->h. */
static void forward(const Model *m, int64_t n, const int64_t *tok, const int64_t *pos, const int64_t *row,
                    const int64_t *page_tables, const Scratch *s) {
    const int64_t hid = m->hidden, dim = m->head_dim, q_dim = m->heads * dim, kv_dim = m->kv_heads * dim;
    const int64_t qkv_w = q_dim + 2 * kv_dim, half = dim / 2;
    for (int64_t r = 0; r < n; ++r) {
        const float *e = m->embed + tok[r] * hid;
        for (int64_t i = 0; i < hid; ++i) s->h[r * hid + i] = e[i];
    }
    for (int64_t layer = 0; layer < m->num_layers; ++layer) {
        float *k_pool = FIELD(m, layer, L_K_POOL), *v_pool = FIELD(m, layer, L_V_POOL);
        const float *q_norm = FIELD(m, layer, L_Q_NORM), *k_norm = FIELD(m, layer, L_K_NORM);
        const int64_t window = m->layers[layer * LAYER_FIELDS + L_WINDOW]; /* a number, not an address: 0 = full */
        for (int64_t r = 0; r < n; ++r) rms_norm(s->h + r * hid, FIELD(m, layer, L_IN_NORM), hid, m->eps, s->xn + r * hid);
        matmul(s->xn, n, hid, FIELD(m, layer, L_QKV), qkv_w, FIELD(m, layer, L_QKV_BIAS), s->qkv, m->bf16, m->threads);
        for (int64_t r = 0; r < n; ++r) {
            float *q = s->qkv + r * qkv_w, *k = q + q_dim, *v = k + kv_dim;
            if (q_norm != NULL && k_norm != NULL) {
                for (int64_t h = 0; h < m->heads; ++h) rms_norm(q + h * dim, q_norm, dim, m->eps, q + h * dim);
                for (int64_t h = 0; h < m->kv_heads; ++h) rms_norm(k + h * dim, k_norm, dim, m->eps, k + h * dim);
            }
            const float *cos = m->cos + pos[r] * half, *sin = m->sin + pos[r] * half;
            rope(q, m->heads, dim, cos, sin);
            rope(k, m->kv_heads, dim, cos, sin);
            /* The token's own K/V go into the pool before any attention of this layer reads it (below). */
            const int64_t *pages = page_tables + row[r] * m->pages_per_seq;
            const int64_t slot = pages[pos[r] / m->page_size] * m->page_size + pos[r] % m->page_size;
            for (int64_t i = 0; i < kv_dim; ++i) {
                k_pool[slot * kv_dim + i] = k[i];
                v_pool[slot * kv_dim + i] = v[i];
            }
        }
        /* Every row's attention after every row's K/V write: a catch-up token sees those of the tokens before it in
         * its run, and the rows can run in parallel, each thread with its own scratch. */
        const int64_t scratch = m->heads * (m->pages_per_seq * m->page_size + 2 * dim);
#pragma omp parallel for num_threads(m->threads) if (m->threads > 1 && n > 1) schedule(dynamic, 1)
        for (int64_t r = 0; r < n; ++r) {
            const int64_t len = pos[r] + 1;
            const PagedDecodeArgs args = {k_pool,   v_pool,      page_tables + row[r] * m->pages_per_seq,
                                          &len,     m->pages_per_seq, m->page_size,
                                          m->heads, m->kv_heads, window,
                                          1.0f / sqrtf((float)dim)};
            float *scores = s->attend_scratch + scratch * omp_get_thread_num();
            float *q_scaled = scores + m->heads * m->pages_per_seq * m->page_size;
            attend(&args, 0, 0, m->kv_heads, dim, s->qkv + r * qkv_w, s->attn + r * q_dim, scores, q_scaled,
                   q_scaled + q_dim);
        }
        matmul(s->attn, n, q_dim, FIELD(m, layer, L_O), hid, FIELD(m, layer, L_O_BIAS), s->delta, m->bf16, m->threads);
        for (int64_t i = 0; i < n * hid; ++i) s->h[i] += s->delta[i];
        for (int64_t r = 0; r < n; ++r)
            rms_norm(s->h + r * hid, FIELD(m, layer, L_POST_NORM), hid, m->eps, s->xn + r * hid);
        matmul(s->xn, n, hid, FIELD(m, layer, L_GATE_UP), 2 * m->inter, FIELD(m, layer, L_GATE_UP_BIAS), s->gate_up, m->bf16, m->threads);
        for (int64_t r = 0; r < n; ++r) {
            const float *g = s->gate_up + r * 2 * m->inter, *u = g + m->inter;
            float *a = s->act + r * m->inter;
            for (int64_t i = 0; i < m->inter; ++i) a[i] = g[i] / (1.0f + expf(-g[i])) * u[i]; /* silu(g) * u */
        }
        matmul(s->act, n, m->inter, FIELD(m, layer, L_DOWN), hid, FIELD(m, layer, L_DOWN_BIAS), s->delta, m->bf16, m->threads);
        for (int64_t i = 0; i < n * hid; ++i) s->h[i] += s->delta[i];
    }
}

/* Index of the largest of x[0 .. n) (the first one on ties, as torch's max does on CPU). */
static int64_t argmax(const float *x, int64_t n) {
    int64_t best = 0;
    for (int64_t i = 1; i < n; ++i) best = x[i] > x[best] ? i : best;
    return best;
}

/* Whether softmax(x)[best] < min_prob, x[best] being the maximum: sum(exp(x - x[best])) > 1 / min_prob. The sum
 * stops once past the bound, so an unsure row costs less than a sure one. */
static int unsure(const float *x, int64_t n, int64_t best, float min_prob) {
    if (min_prob <= 0.0f) return 0;
    const float top = x[best], bound = 1.0f / min_prob;
    float sum = 0.0f;
    for (int64_t i = 0; i < n; ++i) {
        sum += expf(x[i] - top);
        if (sum > bound) return 1;
    }
    return 0;
}

static void *take(float **cursor, int64_t count) {
    float *p = *cursor;
    *cursor += count;
    return p;
}

/* Returns 0 on success, 1 when scratch memory could not be allocated (nothing was written then). */
int ordinal_draft_chain(const float *embed, const void *lm_head, const float *final_norm, const float *cos,
                        const float *sin, const int64_t *layers, const int64_t *dims, float eps, int64_t batch,
                        const int64_t *feed_tokens, const int64_t *feed_offsets, const int64_t *start_pos,
                        const int64_t *page_tables, const int64_t *depths, int64_t max_depth, float min_prob,
                        const int64_t *ban_offsets, const int64_t *ban_tokens, const int64_t *ban_depths,
                        int64_t *out_tokens, int64_t *out_lengths, float *out_logits) {
    /* dims: hidden, inter, heads, kv_heads, head_dim, num_layers, model_vocab, vocab, page_size, bf16,
     * pages_per_seq, threads */
    const Model m = {.hidden = dims[0],
                     .inter = dims[1],
                     .heads = dims[2],
                     .kv_heads = dims[3],
                     .head_dim = dims[4],
                     .num_layers = dims[5],
                     .model_vocab = dims[6],
                     .vocab = dims[7],
                     .page_size = dims[8],
                     .bf16 = (int)dims[9],
                     .pages_per_seq = dims[10],
                     .threads = dims[11] > 1 ? (int)dims[11] : 1,
                     .eps = eps,
                     .embed = embed,
                     .final_norm = final_norm,
                     .cos = cos,
                     .sin = sin,
                     .lm_head = lm_head,
                     .layers = layers};
    const int64_t hid = m.hidden, q_dim = m.heads * m.head_dim, qkv_w = q_dim + 2 * m.kv_heads * m.head_dim;
    const int64_t max_keys = m.pages_per_seq * m.page_size;
    const int64_t rows = feed_offsets[batch]; /* the first forward's: every feed token (>= batch) */
    const int64_t per_row = 3 * hid + qkv_w + q_dim + 3 * m.inter;
    /* Logits only for the rows that choose (one per batch row and forward), not for every catch-up token. */
    const int64_t attend_scratch = m.heads * (max_keys + 2 * m.head_dim); /* per thread */
    const int64_t floats = rows * per_row + batch * m.model_vocab + m.threads * attend_scratch;
    float *memory = malloc(sizeof(float) * (size_t)floats);
    int64_t *ints = malloc(sizeof(int64_t) * (size_t)(3 * rows));
    if (memory == NULL || ints == NULL) {
        free(memory);
        free(ints);
        return 1;
    }
    float *cursor = memory;
    const Scratch s = {take(&cursor, rows * hid),         take(&cursor, rows * hid),
                       take(&cursor, rows * qkv_w),       take(&cursor, rows * q_dim),
                       take(&cursor, rows * 2 * m.inter), take(&cursor, rows * m.inter),
                       take(&cursor, rows * hid),         take(&cursor, batch * m.model_vocab),
                       take(&cursor, m.threads * attend_scratch)};
    int64_t *tok = ints, *pos = tok + rows, *row = pos + rows;
    for (int64_t b = 0; b < batch; ++b) out_lengths[b] = depths[b]; /* shortened where the draft is unsure */

    for (int64_t t = 0; t < max_depth; ++t) {
        /* Forward t: first every row's feed run (a sequence's tokens in position order, so each one's attention
         * finds the K/V of those before it already written in the layer), then each unfinished chain's last token. */
        int64_t n = 0;
        for (int64_t b = 0; b < batch; ++b) {
            const int64_t feed = feed_offsets[b + 1] - feed_offsets[b];
            if (t == 0) {
                for (int64_t j = 0; j < feed; ++j, ++n) {
                    tok[n] = feed_tokens[feed_offsets[b] + j];
                    pos[n] = start_pos[b] + j;
                    row[n] = b;
                }
            } else if (t < out_lengths[b]) {
                tok[n] = out_tokens[b * max_depth + t - 1];
                pos[n] = start_pos[b] + feed + t - 1;
                row[n++] = b;
            }
        }
        if (n == 0) break; /* every chain ended early */
        forward(&m, n, tok, pos, row, page_tables, &s);
        /* Each row's last token of this forward chooses its next chain token: final norm, lm_head, argmax. */
        int64_t chosen = 0;
        for (int64_t r = 0; r < n; ++r) {
            if (r + 1 < n && row[r + 1] == row[r]) continue; /* not the row's last token */
            rms_norm(s.h + r * hid, final_norm, hid, eps, s.xn + chosen * hid);
            row[chosen++] = row[r]; /* compacted in place: chosen <= r, and row[r + 1] was read first */
        }
        matmul(s.xn, chosen, hid, lm_head, m.model_vocab, NULL, s.logits, m.bf16, m.threads);
        for (int64_t c = 0; c < chosen; ++c) {
            const int64_t b = row[c];
            float *logits = s.logits + c * m.model_vocab;
            /* The tokens the request cannot emit at this depth (eos and stop ids before min_new_tokens) are never
             * chosen, and the unsure check weighs the chosen one against the allowed ones only, as the verify's
             * processed row does. */
            if (t < ban_depths[b])
                for (int64_t k = ban_offsets[b]; k < ban_offsets[b + 1]; ++k) logits[ban_tokens[k]] = -INFINITY;
            const int64_t best = argmax(logits, m.vocab);
            out_tokens[b * max_depth + t] = best;
            if (t + 1 < out_lengths[b] && unsure(logits, m.vocab, best, min_prob)) out_lengths[b] = t + 1;
            if (out_logits != NULL) {
                float *dst = out_logits + (b * max_depth + t) * m.vocab;
                for (int64_t i = 0; i < m.vocab; ++i) dst[i] = logits[i];
            }
        }
    }
    free(ints);
    free(memory);
    return 0;
}
