/* XXH64, the 64-bit xxHash: the content hash of checkpoint files, from
 * Debian's libxxhash (the reference implementation). FNV-1a (rng.c) reads a
 * byte at a time and tops out near 1 GB/s; XXH64 reads 8-byte words in four
 * lanes. CRC-32C, bit by bit: it checks TensorBoard records of a few dozen
 * bytes, where a table or the SSE4.2 instruction would gain nothing. */
#include "hypertrain/base.h"

#include <xxhash.h>

uint64_t ht_xxh64(const void *data, size_t n, uint64_t seed) {
    static const char empty[1] = {0}; /* XXH64 asks for a valid pointer even for 0 bytes */
    return (uint64_t)XXH64(n ? data : empty, n, (XXH64_hash_t)seed);
}

uint32_t ht_crc32c(const void *data, size_t n, uint32_t crc) {
    const unsigned char *p = data;
    crc = ~crc;
    for (size_t i = 0; i < n; i++) {
        crc ^= p[i];
        for (int b = 0; b < 8; b++) crc = (crc >> 1) ^ (0x82F63B78u & (0u - (crc & 1u)));
    }
    return ~crc;
}
