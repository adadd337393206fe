/* hypertrain base layer: errors, dtypes and their conversions, logging,
 * random numbers, hashing and a small JSON reader. Everything else builds on it. */
#ifndef HYPERTRAIN_BASE_H
#define HYPERTRAIN_BASE_H

#include <stdarg.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>
#include <stdio.h>

#ifdef __cplusplus
extern "C" {
#endif

/* ---------------------------------------------------------------- errors */

typedef enum ht_status {
    HT_OK = 0,
    HT_ERR_IO,      /* a file could not be opened, read or written */
    HT_ERR_FORMAT,  /* a file's content is malformed */
    HT_ERR_CONFIG,  /* the configuration is invalid */
    HT_ERR_INVALID, /* an argument or a state is invalid */
    HT_ERR_OOM,     /* an allocation failed */
    HT_ERR_NUMERIC, /* a non-finite value where none may be */
} ht_status;

#define HT_ERROR_MSG_MAX 2048

/* An error is a value: a status and a sentence naming what was wrong. */
typedef struct ht_error {
    ht_status status;
    char msg[HT_ERROR_MSG_MAX];
    /* Every rank of the world holds this same error, having agreed on it in
     * a collective: one report (rank 0's) says it all. ht_fail clears it. */
    bool everywhere;
} ht_error;

/* Formats the message into err (when err is not NULL) and returns status. */
ht_status ht_fail(ht_error *err, ht_status status, const char *fmt, ...) __attribute__((format(printf, 3, 4)));
const char *ht_status_name(ht_status status);

/* Allocation that is zeroed and 64-byte aligned; NULL on failure. A large
 * block's pages are mapped by all the threads, not zeroed by one. Free it
 * with ht_free, never free(): the block does not start where calloc's does. */
void *ht_alloc(size_t bytes);
void ht_free(void *ptr);

/* ---------------------------------------------------------------- arenas */

/* bytes rounded up to a multiple of 64: a cache line, and every SIMD width. */
static inline size_t ht_align64(size_t bytes) { return (bytes + 63) & ~(size_t)63; }

/* One allocation carved into named pieces, each 64-byte aligned (the llm.c
 * way: a table of sizes, one block, pointers into it). With base NULL,
 * ht_arena_take only counts, so the same calls can size the block first;
 * with base set, it hands out the pieces in the order asked. */
typedef struct ht_arena {
    char *base;  /* the block; NULL while sizing */
    size_t used; /* bytes handed out (or counted) so far */
} ht_arena;

static inline void *ht_arena_take(ht_arena *a, size_t bytes) {
    void *piece = a->base ? a->base + a->used : NULL;
    a->used += ht_align64(bytes);
    return piece;
}

/* ---------------------------------------------------------------- dtypes */

typedef enum ht_dtype {
    HT_DTYPE_F32 = 0,
    HT_DTYPE_BF16,
    HT_DTYPE_F16,
    HT_DTYPE_I32,
    HT_DTYPE_I64,
    HT_DTYPE_U16,
    HT_DTYPE_U8,
    HT_DTYPE_COUNT
} ht_dtype;

size_t ht_dtype_size(ht_dtype dtype);
bool ht_dtype_is_float(ht_dtype dtype);
/* Names as the config spells them: "float32", "bfloat16", "float16", ... */
const char *ht_dtype_name(ht_dtype dtype);
bool ht_dtype_from_name(const char *name, ht_dtype *out);
/* Names as safetensors spells them: "F32", "BF16", "F16", "I32", ... */
const char *ht_dtype_safetensors_name(ht_dtype dtype);
bool ht_dtype_from_safetensors_name(const char *name, ht_dtype *out);

/* Round-to-nearest-even conversions (docs/NUMERICS.md, floating-point formats).
 * The bf16 pair is inline so that the loops calling it, in any file,
 * vectorize. */
static inline uint16_t ht_f32_to_bf16(float x) {
    uint32_t u;
    memcpy(&u, &x, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x0040u); /* NaN stays quiet NaN */
    u += 0x7fffu + ((u >> 16) & 1u); /* round to nearest, ties to even; overflow carries into Inf */
    return (uint16_t)(u >> 16);
}

static inline float ht_bf16_to_f32(uint16_t x) {
    uint32_t u = (uint32_t)x << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

uint16_t ht_f32_to_f16(float x);
float ht_f16_to_f32(uint16_t x);

/* FP32 -> bf16 or f16 with stochastic rounding: each value becomes one of its
 * two neighbours with probability proportional to closeness, from a
 * counter-based stream (seed, element index), so a result is reproducible. */
void ht_convert_stochastic(uint16_t *dst, ht_dtype dst_dtype, const float *src, size_t n, uint64_t seed);
/* The same for elements [first, first + n) of a longer array (dst and src
 * point at element `first`): each draws the number it draws in one call over
 * the whole array, so a tensor may be rounded piece by piece. */
void ht_convert_stochastic_at(uint16_t *dst, ht_dtype dst_dtype, const float *src, size_t n, uint64_t seed,
                              size_t first);

/* Rounds n FP32 values in place to the precision of `precision` (bf16 or f16,
 * round to nearest even, as the conversions); F32 leaves them as they are. */
void ht_round_to(float *x, size_t n, ht_dtype precision);

/* Converts n elements between any two float dtypes (f32, bf16, f16). */
void ht_convert(void *dst, ht_dtype dst_dtype, const void *src, ht_dtype src_dtype, size_t n);

/* ---------------------------------------------------------------- logging */

typedef enum ht_log_level { HT_LOG_DEBUG = 0, HT_LOG_INFO, HT_LOG_WARN, HT_LOG_ERROR } ht_log_level;

/* The log sink is process-global: by default stderr, level INFO, rank 0 only. */
void ht_log_set_level(ht_log_level level);
ht_log_level ht_log_get_level(void);
void ht_log_set_rank(int rank);
void ht_log(ht_log_level level, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
#define ht_log_info(...) ht_log(HT_LOG_INFO, __VA_ARGS__)
#define ht_log_warn(...) ht_log(HT_LOG_WARN, __VA_ARGS__)
#define ht_log_debug(...) ht_log(HT_LOG_DEBUG, __VA_ARGS__)
/* A warning every rank reaches alike (about the config or the data): rank 0
 * prints it, once for the world, where ht_log_warn prints it on every rank. */
void ht_log_warn_once(const char *fmt, ...) __attribute__((format(printf, 1, 2)));

/* Monotonic wall clock in seconds. */
double ht_time_seconds(void);

/* ---------------------------------------------------------------- tracing */

/* training.trace (src/base/trace.c): spans of named work recorded while a
 * capture is on, for a Chrome/Perfetto trace. The process-wide switch is read
 * inline, so a span not captured costs one branch. Tracks: the calling
 * thread's (nested spans: phases, collectives, kernel entries), and two of
 * their own for the FSDP exchanges in flight beside the compute. */
enum { HT_TRACE_THREAD = -1, HT_TRACE_GATHERS = 1, HT_TRACE_REDUCES = 2 };
extern bool ht_trace_on;
/* Starts capturing (the calling thread is track 0); stop ends it. */
void ht_trace_start(void);
void ht_trace_stop(void);
/* A span from t0 to t1 (ht_time_seconds) on `track` (HT_TRACE_THREAD: the
 * calling thread's), of category `cat` ("phase", "comm", "fsdp", "kernel"),
 * named `name` (copied); bytes >= 0 is recorded as an argument, and so is
 * step >= 0. Nothing unless a capture is on. */
void ht_trace_span(const char *cat, const char *name, int track, double t0, double t1, int64_t bytes, int64_t step);
/* Appends the spans captured so far to f as trace events (Chrome's trace
 * event format, "X" events with "ts"/"dur" in microseconds, pid `pid`),
 * each track's in time order, and forgets them; `first`: the file's first
 * events, after the metadata naming the process and the tracks. */
void ht_trace_flush(FILE *f, int pid, bool first);

/* OpenMP's idle threads spin only briefly (1000 iterations) before they
 * sleep when the machine is busy at start (other processes running), and as
 * the runtime's default otherwise;
 * the environment (OMP_WAIT_POLICY, GOMP_SPINCOUNT, KMP_BLOCKTIME) wins.
 * The runtime reads these only when it loads: a process that changes them
 * executes itself again. Call first thing in main, before any thread or MPI. */
void ht_openmp_settle(char **argv);
/* Whether /proc/loadavg's text says another process is running too. */
bool ht_openmp_machine_busy(const char *loadavg);
/* How the idle threads wait, for the log. */
const char *ht_openmp_wait(void);

/* ---------------------------------------------------------------- random numbers */

/* A splitmix64-seeded xoshiro256** generator: a state that checkpoints as four words. */
typedef struct ht_rng {
    uint64_t s[4];
} ht_rng;

void ht_rng_seed(ht_rng *rng, uint64_t seed);
uint64_t ht_rng_next(ht_rng *rng);
/* Uniform in [0, n), without modulo bias. */
uint64_t ht_rng_below(ht_rng *rng, uint64_t n);
/* Uniform in [0, 1) with 24 random bits. */
float ht_rng_uniform(ht_rng *rng);
/* Standard normal (Box-Muller). */
float ht_rng_normal(ht_rng *rng);

/* Counter-based streams (the weights' initialisation): value i of stream
 * `key` is a pure function of (key, i), so a rank draws its own rows
 * directly and every sharding, thread count and build gives the same values.
 * Philox4x32-10 (Salmon et al., "Parallel random numbers: as easy as 1, 2,
 * 3", SC'11; Random123's reference): block ctr of the key's stream. */
void ht_philox4x32(const uint32_t ctr[4], const uint32_t key[2], uint32_t out[4]);
/* Values [first, first + n) of stream `key` into out: scale · z, z standard
 * normal (Box-Muller on two 32-bit words: values 4j .. 4j + 3 come from block
 * j). OpenMP-parallel for large n. */
void ht_random_normal(float *out, int64_t n, uint64_t key, int64_t first, float scale);
/* Values [first, first + n) of stream `key` into out: uniform in [0, 1) with
 * 24 random bits, value i from word i % 4 of block i / 4. */
void ht_random_uniform(float *out, int64_t n, uint64_t key, int64_t first);

/* ---------------------------------------------------------------- registries */

/* A name -> function registry (the models' builders, the datasets' openers).
 * Built-ins register on first use; plugins add theirs through the public API.
 * Functions are stored as the generic ht_registry_fn and cast back by the owner. */
typedef void (*ht_registry_fn)(void);
#define HT_REGISTRY_MAX 32
#define HT_REGISTRY_NAME_MAX 32

typedef struct ht_registry {
    const char *what;                /* "model", "dataset": for messages */
    void (*register_builtins)(void); /* called once, before the first use */
    bool builtins_done;
    int count;
    char names[HT_REGISTRY_MAX][HT_REGISTRY_NAME_MAX];
    ht_registry_fn fns[HT_REGISTRY_MAX];
    char list[HT_REGISTRY_MAX * (HT_REGISTRY_NAME_MAX + 2)]; /* "a, b, c" */
} ht_registry;

/* Adds name -> fn; an empty, too long or already registered name is an error. */
ht_status ht_registry_add(ht_registry *r, const char *name, ht_registry_fn fn, ht_error *err);
/* The function registered under name, or NULL. */
ht_registry_fn ht_registry_find(ht_registry *r, const char *name);
/* The registered names, comma-separated, for error messages. */
const char *ht_registry_names(ht_registry *r);

/* ---------------------------------------------------------------- hashing */

/* FNV-1a 64 over a byte range, chainable through `seed` (start with HT_FNV64_INIT). */
#define HT_FNV64_INIT 0xcbf29ce484222325ULL
uint64_t ht_fnv1a64(const void *data, size_t n, uint64_t seed);
/* XXH64 (xxHash's 64-bit hash, the reference algorithm: four lanes over
 * 8-byte words, ~10 GB/s on one core) over a byte range. Checkpoints name it
 * "xxh64" and hash every file with seed 0. */
uint64_t ht_xxh64(const void *data, size_t n, uint64_t seed);
/* CRC-32C (Castagnoli, reflected polynomial 0x82F63B78; "123456789" ->
 * 0xE3069283), chainable through `crc` (start with 0): the checksum of
 * TFRecord framing (TensorBoard's event files). */
uint32_t ht_crc32c(const void *data, size_t n, uint32_t crc);

/* ---------------------------------------------------------------- files */

/* Every file a user names is opened here (or by the two readers below):
 * for reading, its type checked before any read, so that a FIFO, a device, a
 * socket or a directory is an error naming the file and what it is, at once,
 * where a plain open of a FIFO waits for a writer forever. The descriptor
 * (close-on-exec, blocking) and the file's size are the caller's. */
ht_status ht_open_file(const char *path, int *fd, size_t *size, ht_error *err);
/* Reads a whole file into a malloc'ed buffer (NUL-terminated for convenience),
 * refusing, before reading a byte, a file larger than this machine's memory. */
ht_status ht_read_file(const char *path, char **out, size_t *out_size, ht_error *err);
/* The same, refusing a file of more than max_bytes by its size before reading
 * it: HT_ERR_FORMAT, with *out_size its size. `what` names the kind of file
 * and the cap in the message ("a checkpoint's metadata.json may have"). */
ht_status ht_read_file_max(const char *path, size_t max_bytes, const char *what, char **out, size_t *out_size,
                           ht_error *err);
/* The machine's physical memory in bytes (sysconf), SIZE_MAX when unknown:
 * what a size implies is checked against it before anything is allocated. */
size_t ht_physical_memory(void);
/* The JSON files the engine reads (config.json, model.safetensors.index.json,
 * metadata.json) are kilobytes to a few megabytes; a bigger one is not one of
 * them. Raise it here and rebuild. */
#define HT_JSON_FILE_MAX ((size_t)256 << 20)
/* mkdir -p: creates path and any missing parents. */
ht_status ht_make_dirs(const char *path, ht_error *err);

/* ---------------------------------------------------------------- JSON */

typedef enum ht_json_type {
    HT_JSON_NULL = 0,
    HT_JSON_BOOL,
    HT_JSON_NUMBER,
    HT_JSON_STRING,
    HT_JSON_ARRAY,
    HT_JSON_OBJECT,
} ht_json_type;

/* A parsed JSON value. Arrays and objects hold `count` children in `items`;
 * object children carry their key. The whole tree is owned by its root. */
typedef struct ht_json {
    ht_json_type type;
    bool boolean;
    double number;
    char *string; /* HT_JSON_STRING: the decoded string */
    char *key;    /* set on the children of an object */
    struct ht_json *items;
    size_t count;
} ht_json;

/* Parses text[0, len). On failure the error names `what` (a file name) and the byte offset. */
ht_status ht_json_parse(const char *text, size_t len, const char *what, ht_json **out, ht_error *err);
void ht_json_free(ht_json *root);
/* Reads a JSON file of at most HT_JSON_FILE_MAX bytes and parses it; `kind`
 * names the file in the cap's message ("a config.json"). */
ht_status ht_json_read_file(const char *path, const char *kind, ht_json **out, ht_error *err);
/* Object member by key, or NULL. */
const ht_json *ht_json_get(const ht_json *obj, const char *key);

/* -- JSON writing (added with the safetensors/Hugging Face layer) -- */
#include <stdio.h>
/* Writes s as a quoted JSON string: quotes, backslashes and control
 * characters escaped, other bytes (UTF-8) as they are. */
void ht_json_write_string(FILE *f, const char *s);
/* Writes x in the shortest form that reads back to the same double
 * ("10000", "1e-06", "0.02"); null when x is not finite (JSON has no Inf/NaN). */
void ht_json_write_number(FILE *f, double x);

#ifdef __cplusplus
}
#endif
#endif
