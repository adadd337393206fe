/* XXH64, the 64-bit xxHash: the content hash of checkpoint files, from
 * Debian's libxxhash (the reference implementation). FNV-1a (rng.c) reads a
 * byte at a time and tops out near 1 GB/s; XXH64 reads 8-byte words in four
 * lanes. */
#include "hypertrain/base.h"

#include <xxhash.h>

uint64_t ht_xxh64(const void *data, size_t n, uint64_t seed) {
    static const char empty[1] = {0}; /* XXH64 asks for a valid pointer even for 0 bytes */
    return (uint64_t)XXH64(n ? data : empty, n, (XXH64_hash_t)seed);
}
