/* Before main, and before any code compiled for the build's -march can run:
 * a CPU the binary cannot run on gets one sentence naming what it lacks,
 * instead of an illegal-instruction crash somewhere inside a kernel. This
 * file alone is compiled for baseline x86-64 (CMakeLists.txt), so the check
 * itself runs anywhere. */
#include "cli/cpu_check.h"

#include <stdbool.h>
#include <stdio.h>
#include <string.h>
#include <unistd.h>

#ifndef HT_MARCH
#define HT_MARCH "?"
#endif

typedef struct cpu_feature {
    const char *name;
    bool present;
} cpu_feature;

static bool build_uses(const char *name) {
    size_t n = strlen(name);
    for (const char *at = strstr(ht_build_isa, name); at; at = strstr(at + 1, name))
        if (at[-1] == ' ' && (at[n] == ' ' || at[n] == '\0')) return true;
    return false;
}

/* Runs first among the binary's constructors. */
__attribute__((constructor(101))) static void check_cpu(void) {
    __builtin_cpu_init();
    /* __builtin_cpu_supports takes literal names; these are the ones gcc and
     * clang both know. The rest (f16c, avx512fp16, avxvnni, vaes, amx-tile)
     * only gcc can ask about. */
    const cpu_feature features[] = {
        {"avx", __builtin_cpu_supports("avx")},
        {"avx2", __builtin_cpu_supports("avx2")},
        {"fma", __builtin_cpu_supports("fma")},
        {"bmi", __builtin_cpu_supports("bmi")},
        {"bmi2", __builtin_cpu_supports("bmi2")},
        {"avx512f", __builtin_cpu_supports("avx512f")},
        {"avx512cd", __builtin_cpu_supports("avx512cd")},
        {"avx512bw", __builtin_cpu_supports("avx512bw")},
        {"avx512dq", __builtin_cpu_supports("avx512dq")},
        {"avx512vl", __builtin_cpu_supports("avx512vl")},
        {"avx512bf16", __builtin_cpu_supports("avx512bf16")},
        {"avx512vnni", __builtin_cpu_supports("avx512vnni")},
        {"avx512vbmi", __builtin_cpu_supports("avx512vbmi")},
        {"avx512vbmi2", __builtin_cpu_supports("avx512vbmi2")},
        {"avx512ifma", __builtin_cpu_supports("avx512ifma")},
        {"avx512bitalg", __builtin_cpu_supports("avx512bitalg")},
        {"avx512vpopcntdq", __builtin_cpu_supports("avx512vpopcntdq")},
        {"avx512vp2intersect", __builtin_cpu_supports("avx512vp2intersect")},
        {"gfni", __builtin_cpu_supports("gfni")},
        {"vpclmulqdq", __builtin_cpu_supports("vpclmulqdq")},
#if defined(__GNUC__) && !defined(__clang__)
        {"f16c", __builtin_cpu_supports("f16c")},
        {"avx512fp16", __builtin_cpu_supports("avx512fp16")},
        {"avxvnni", __builtin_cpu_supports("avxvnni")},
        {"vaes", __builtin_cpu_supports("vaes")},
        {"amx-tile", __builtin_cpu_supports("amx-tile")},
#endif
    };
    const int n = (int)(sizeof(features) / sizeof(features[0]));
    /* The engine's minimum first; then what this build adds to it. */
    bool baseline = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
    char missing[512] = "";
    size_t len = 0;
    for (int i = 0; i < n && len < sizeof(missing); i++) {
        bool minimum = strcmp(features[i].name, "avx2") == 0 || strcmp(features[i].name, "fma") == 0;
        if (features[i].present || !(baseline ? build_uses(features[i].name) : minimum)) continue;
        len += (size_t)snprintf(missing + len, sizeof(missing) - len, "%s%s", len ? ", " : "", features[i].name);
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
