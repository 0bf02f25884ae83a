/* The reuse key's hash chain (engine/kv/chain_hash.py) over many pages in one call:
 *
 *     h_i = xxh3_128(h_{i-1} || tokens of page i as little-endian uint32)
 *
 * each written as xxHash's canonical 16 bytes (big-endian high then low half), the bytes Python's
 * xxhash.xxh3_128_digest returns. The Python loop costs ~0.3-0.5 µs a page in the interpreter
 * around a ~20 ns hash; here the loop is C. Its oracle is that Python loop
 * (tests/test_chain_hash.py). xxHash itself is the vendored single header (vendor/xxhash/, BSD-2,
 * the version python-xxhash 4.1.0 bundles), inlined. kernels/cpu/chain_hash.py binds this.
 */
#include <stdint.h>
#include <string.h>

#define XXH_INLINE_ALL
#include "vendor/xxhash/xxhash.h"

#define HASH_BYTES 16
#define MAX_PAGE_TOKENS 4096

/* parent: 16 bytes; tokens: pages * page_size uint32 ids; out: pages * 16 bytes. Returns 0, or -1
 * for a page size it does not take (the caller runs the Python loop). */
int chain_page_hashes(const uint8_t *parent, const uint32_t *tokens, int64_t pages, int64_t page_size,
                      uint8_t *out) {
    if (page_size <= 0 || page_size > MAX_PAGE_TOKENS || pages < 0) return -1;
    uint8_t buf[HASH_BYTES + 4 * MAX_PAGE_TOKENS];
    const size_t width = 4 * (size_t)page_size;
    memcpy(buf, parent, HASH_BYTES);
    for (int64_t i = 0; i < pages; i++) {
        const uint32_t *page = tokens + i * page_size;
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_BIG_ENDIAN__
        for (int64_t j = 0; j < page_size; j++) {
            const uint32_t t = __builtin_bswap32(page[j]);
            memcpy(buf + HASH_BYTES + 4 * j, &t, 4);
        }
#else
        memcpy(buf + HASH_BYTES, page, width);
#endif
        XXH128_canonical_t canonical;
        XXH128_canonicalFromHash(&canonical, XXH3_128bits(buf, HASH_BYTES + width));
        memcpy(out + i * HASH_BYTES, canonical.digest, HASH_BYTES);
        memcpy(buf, canonical.digest, HASH_BYTES); /* the next page's parent */
    }
    return 0;
}
