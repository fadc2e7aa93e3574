/* A grammar's token bitmask applied to CPU logits in place: every token whose bit is clear becomes -inf.
 *
 * Built by engine/model/native.py like paged_decode.c. The sampler calls it once per step for all rows: the torch
 * path expands the words into a [B, V] table of caps with several ops, each a dispatch (and a GIL handoff while
 * the grammar's commit runs beside it); this is one call that releases the GIL and touches only the banned tokens.
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
            uint32_t banned = ~row_words[i];
            const int64_t base = i * 32;
            while (banned != 0) {
                const int64_t token = base + __builtin_ctz(banned);
                if (token >= vocab) {
                    break; /* bits are visited in increasing order: the rest are past the vocabulary too */
                }
                row[token] = -INFINITY;
                banned &= banned - 1; /* clear the lowest set bit */
            }
        }
    }
}
