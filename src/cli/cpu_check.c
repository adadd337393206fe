/* Before main, and before any code compiled for the build's -march can run:
 * a CPU the binary cannot run on gets one sentence naming what it lacks,
 * instead of an illegal-instruction crash somewhere inside a kernel. This
 * file alone is compiled for baseline x86-64 (CMakeLists.txt), so the check
 * itself runs anywhere.
 *
 * The CPU is read with CPUID and XGETBV directly rather than through
 * __builtin_cpu_supports: that builtin knows a different set of names in gcc
 * and in clang, and an extension it cannot name would go unchecked. Every
 * extension build_isa.c can list has a row here. */
#include "cli/cpu_check.h"

#include <cpuid.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>
#include <unistd.h>

#ifndef HT_MARCH
#define HT_MARCH "?"
#endif

enum { EAX, EBX, ECX, EDX };

/* XCR0's state components the OS must save for an extension's registers. */
#define XCR0_AVX 0x6u     /* SSE and YMM */
#define XCR0_AVX512 0xe6u /* and the opmask, ZMM0-15's upper halves, ZMM16-31 */
#define XCR0_AMX 0x60000u /* TILECFG and TILEDATA */

/* One extension: CPUID leaf and subleaf, the register and bit that say it is
 * there, and the XCR0 components it needs enabled. The names are build_isa.c's. */
typedef struct cpu_feature {
    const char *name;
    uint32_t leaf, subleaf;
    int reg, bit;
    uint32_t xcr0;
} cpu_feature;

static const cpu_feature features[] = {
    {"avx", 1, 0, ECX, 28, XCR0_AVX},
    {"avx2", 7, 0, EBX, 5, XCR0_AVX},
    {"fma", 1, 0, ECX, 12, XCR0_AVX},
    {"f16c", 1, 0, ECX, 29, XCR0_AVX},
    {"bmi", 7, 0, EBX, 3, 0},
    {"bmi2", 7, 0, EBX, 8, 0},
    {"lzcnt", 0x80000001u, 0, ECX, 5, 0},
    {"movbe", 1, 0, ECX, 22, 0},
    {"popcnt", 1, 0, ECX, 23, 0},
    {"pclmul", 1, 0, ECX, 1, 0},
    {"aes", 1, 0, ECX, 25, 0},
    {"sse4a", 0x80000001u, 0, ECX, 6, 0},
    {"avx512f", 7, 0, EBX, 16, XCR0_AVX512},
    {"avx512cd", 7, 0, EBX, 28, XCR0_AVX512},
    {"avx512bw", 7, 0, EBX, 30, XCR0_AVX512},
    {"avx512dq", 7, 0, EBX, 17, XCR0_AVX512},
    {"avx512vl", 7, 0, EBX, 31, XCR0_AVX512},
    {"avx512bf16", 7, 1, EAX, 5, XCR0_AVX512},
    {"avx512fp16", 7, 0, EDX, 23, XCR0_AVX512},
    {"avx512vnni", 7, 0, ECX, 11, XCR0_AVX512},
    {"avx512vbmi", 7, 0, ECX, 1, XCR0_AVX512},
    {"avx512vbmi2", 7, 0, ECX, 6, XCR0_AVX512},
    {"avx512ifma", 7, 0, EBX, 21, XCR0_AVX512},
    {"avx512bitalg", 7, 0, ECX, 12, XCR0_AVX512},
    {"avx512vpopcntdq", 7, 0, ECX, 14, XCR0_AVX512},
    {"avx512vp2intersect", 7, 0, EDX, 8, XCR0_AVX512},
    {"avxvnni", 7, 1, EAX, 4, XCR0_AVX},
    {"gfni", 7, 0, ECX, 8, 0},
    {"vaes", 7, 0, ECX, 9, XCR0_AVX},
    {"vpclmulqdq", 7, 0, ECX, 10, XCR0_AVX},
    {"sha", 7, 0, EBX, 29, 0},
    {"adx", 7, 0, EBX, 19, 0},
    {"rdseed", 7, 0, EBX, 18, 0},
    {"amx-tile", 7, 0, EDX, 24, XCR0_AMX},
    {"amx-bf16", 7, 0, EDX, 22, XCR0_AMX},
    {"amx-int8", 7, 0, EDX, 25, XCR0_AMX},
};

/* The state components the OS saves: XGETBV's XCR0 where CPUID says OSXSAVE, else none. */
static uint32_t os_xcr0(void) {
    unsigned a, b, c, d;
    if (!__get_cpuid(1, &a, &b, &c, &d) || !(c & (1u << 27))) return 0;
    uint32_t lo, hi;
    __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
    (void)hi;
    return lo;
}

static bool cpu_has(const cpu_feature *f, uint32_t xcr0) {
    unsigned r[4];
    if (!__get_cpuid_count(f->leaf, f->subleaf, &r[EAX], &r[EBX], &r[ECX], &r[EDX])) return false;
    return (r[f->reg] >> f->bit & 1u) && (xcr0 & f->xcr0) == f->xcr0;
}

/* The engine's own minimum, whatever the build: x86-64-v3's AVX2 and FMA. */
static bool engine_minimum(const char *name) { return strcmp(name, "avx2") == 0 || strcmp(name, "fma") == 0; }

static bool build_uses(const char *name) {
    size_t n = strlen(name);
    for (const char *at = strstr(ht_build_isa, name); at; at = strstr(at + 1, name))
        if (at[-1] == ' ' && (at[n] == ' ' || at[n] == '\0')) return true;
    return false;
}

/* Runs first among the binary's constructors. */
__attribute__((constructor(101))) static void check_cpu(void) {
    const uint32_t xcr0 = os_xcr0();
    const int n = (int)(sizeof(features) / sizeof(features[0]));
    /* The engine's minimum first; then what this build adds to it. */
    bool baseline = true;
    for (int i = 0; i < n; i++)
        if (engine_minimum(features[i].name)) baseline = baseline && cpu_has(&features[i], xcr0);
    char missing[512] = "";
    size_t len = 0;
    for (int i = 0; i < n && len < sizeof(missing); i++) {
        const char *name = features[i].name;
        if (!(baseline ? build_uses(name) : engine_minimum(name)) || cpu_has(&features[i], xcr0)) continue;
        len += (size_t)snprintf(missing + len, sizeof(missing) - len, "%s%s", len ? ", " : "", name);
    }
    if (!missing[0]) return;
    if (!baseline)
        fprintf(stderr,
                "hypertrain: this CPU lacks %s; hypertrain needs an x86-64 CPU with AVX2 and FMA (x86-64-v3: "
                "Intel Haswell, AMD Zen or later)\n",
                missing);
    else
        fprintf(stderr,
                "hypertrain: this CPU lacks %s, which this binary was compiled to use (-march=%s, on another CPU); "
                "rebuild it here (make build), or build a portable binary with cmake -DHT_MARCH=x86-64-v3\n",
                missing, HT_MARCH);
    _exit(1);
}
