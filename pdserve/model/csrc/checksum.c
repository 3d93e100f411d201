/* Page checksums for the KV handoff: one int64 per page, the wrapping sum of its 8-byte words,
 * word i weighted by the odd number (i + 1) | 1 (so swapped words change it). The same figure
 * as the torch reference in pdserve/serving/kv_pages.py, in one pass and no temporaries. */
#include <stdint.h>

void page_checksums(const uint8_t *base, int64_t page_nbytes, const int64_t *pages, int64_t n,
                    int64_t *out) {
    const int64_t words = page_nbytes / 8;
    for (int64_t p = 0; p < n; p++) {
        const uint64_t *w = (const uint64_t *)(base + pages[p] * page_nbytes);
        uint64_t acc = 0;
#pragma omp simd reduction(+ : acc)
        for (int64_t i = 0; i < words; i++) acc += w[i] * ((uint64_t)(i + 1) | 1u);
        out[p] = (int64_t)acc;
    }
}
