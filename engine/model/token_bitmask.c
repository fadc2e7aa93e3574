/* A grammar's token bitmask applied to CPU logits in place: every token whose bit is clear becomes -inf.
 *
 * Built by engine/model/native.py like paged_decode.c. The sampler calls it once per step for all rows: the torch
 * path expands the words into a [B, V] table of caps with several ops, each a dispatch (and a GIL handoff while
 * the grammar's commit runs beside it); this is one call that releases the GIL and skips the words that allow
 * everything.
 *
 * Layouts:
 *   logits [rows, >= vocab]           float32, row r starts at logits + r * logits_stride
 *   words  [rows, >= ceil(vocab/32)]  int32 (xgrammar layout: bit j of word i set <=> token 32 * i + j allowed),
 *                                     row r starts at words + r * words_stride
 * Bits for ids at or above vocab are ignored.
 */

#include <math.h>
#include <stdint.h>

void ordinal_apply_token_bitmask(float *logits, const int32_t *words, int64_t rows, int64_t vocab,
                                 int64_t logits_stride, int64_t words_stride) {
    const int64_t used_words = (vocab + 31) / 32;
    for (int64_t r = 0; r < rows; ++r) {
        float *row = logits + r * logits_stride;
        const uint32_t *row_words = (const uint32_t *)(words + r * words_stride);
        for (int64_t i = 0; i < used_words; ++i) {
            const uint32_t allowed = row_words[i];
            if (allowed == 0xFFFFFFFFu) {
                continue;
            }
            float *out = row + i * 32;
            const int64_t n = vocab - i * 32 < 32 ? vocab - i * 32 : 32; /* the last word may run past the vocabulary */
            if (allowed == 0) { /* the common word of a grammar's mask: nothing allowed */
                for (int64_t j = 0; j < n; ++j) {
                    out[j] = -INFINITY;
                }
                continue;
            }
            for (int64_t j = 0; j < n; ++j) {
                out[j] = ((allowed >> j) & 1u) ? out[j] : -INFINITY;
            }
        }
    }
}
