/* A step's keys and values into their cache slots on CPU: one call, each token's row copied whole.
 *
 * The torch form (kernels/reference.py write_kv) is five ops and a host read of the slots' sign; at one
 * stream's decode step that is ~25 us a layer on the one core that runs between two products, while the
 * other core waits for the next (bench/log/2026-12-07.md, "(third session)"). The slots are checked before
 * any row is written: one past the cache is an error (-1, nothing written), never a wild write; a negative slot
 * (-1) is padding and skipped, as the torch form skips it.
 *
 * key [T] rows of row_bytes (a token's heads and dims contiguous), key_stride bytes apart; value alike;
 * caches [slots][row_bytes] contiguous; slots [T] int64.
 */
#include <stdint.h>
#include <string.h>

int write_kv_rows(const char *key, int64_t key_stride, const char *value, int64_t value_stride, char *k_cache,
                  char *v_cache, const int64_t *slots, int64_t tokens, int64_t row_bytes, int64_t num_slots) {
    for (int64_t t = 0; t < tokens; t++)
        if (slots[t] >= num_slots) return -1;
    for (int64_t t = 0; t < tokens; t++) {
        const int64_t slot = slots[t];
        if (slot < 0) continue;
        memcpy(k_cache + slot * row_bytes, key + t * key_stride, (size_t)row_bytes);
        memcpy(v_cache + slot * row_bytes, value + t * value_stride, (size_t)row_bytes);
    }
    return 0;
}
