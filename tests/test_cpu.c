/* The CPU check before main (src/cli/cpu_check.c), on emulated CPUs: the
 * hypertrain binary runs under qemu-x86_64 with a CPU model that lacks AVX2
 * (Nehalem), and one with AVX2 but no AVX-512 (Haswell; qemu emulates no
 * AVX-512 at all). Each must get one sentence naming what is missing, never
 * an illegal-instruction crash; a binary built for x86-64-v3 must run on
 * Haswell. This test is compiled with the binary's flags, so __AVX512F__,
 * __VAES__ and the like tell whether the binary uses what Haswell lacks. */
#include "harness.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>

/* Runs `hypertrain --help` on an emulated CPU; returns its exit status and
 * its output (qemu's own warnings about CPUID bits it does not emulate included). */
static int run_on(const char *cpu, char *out, size_t n) {
    const char *bin = getenv("HT_BIN");
    if (!bin) fail_msg("HT_BIN is not set (run the test through ctest)");
    const char *path = scratch_dir("cpu");
    char file[1200], cmd[4096];
    snprintf(file, sizeof(file), "%s/%s.txt", path, cpu);
    snprintf(cmd, sizeof(cmd), "qemu-x86_64 -cpu %s '%s' --help > '%s' 2>&1", cpu, bin, file);
    int rc = system(cmd);
    FILE *f = fopen(file, "r");
    assert_non_null(f);
    size_t len = fread(out, 1, n - 1, f);
    out[len] = '\0';
    fclose(f);
    return WIFEXITED(rc) ? WEXITSTATUS(rc) : -1;
}

static void test_qemu_is_there(void **state) {
    (void)state;
    /* scripts/install-deps.sh installs qemu-user; without it the tests below would prove nothing. */
    assert_int_equal(system("qemu-x86_64 -version > /dev/null"), 0);
}

static void test_no_avx2_is_one_sentence(void **state) {
    (void)state;
    char out[4096];
    int rc = run_on("Nehalem", out, sizeof(out));
    printf("Nehalem: rc %d: %.600s", rc, out);
    assert_int_equal(rc, 1);
    assert_non_null(strstr(out, "hypertrain: this CPU lacks avx2, fma; hypertrain needs an x86-64 CPU with AVX2"));
    assert_null(strstr(out, "usage"));
}

/* What this build uses that qemu's Haswell lacks (it emulates no AVX-512). */
static const char *const beyond_haswell[] = {
#ifdef __AVX512F__
    "avx512f",
#endif
#ifdef __VAES__
    "vaes",
#endif
#ifdef __VPCLMULQDQ__
    "vpclmulqdq",
#endif
#ifdef __GFNI__
    "gfni",
#endif
#ifdef __SHA__
    "sha",
#endif
#ifdef __ADX__
    "adx",
#endif
#ifdef __RDSEED__
    "rdseed",
#endif
#ifdef __SSE4A__
    "sse4a",
#endif
#ifdef __AVXVNNI__
    "avxvnni",
#endif
#ifdef __AMX_TILE__
    "amx-tile",
#endif
    NULL};

static void test_avx2_cpu(void **state) {
    (void)state;
    char out[4096];
    int rc = run_on("Haswell-v4", out, sizeof(out));
    printf("Haswell: rc %d: %.600s\n", rc, out);
    if (!beyond_haswell[0]) {
        /* A portable build runs. */
        assert_int_equal(rc, 0);
        assert_non_null(strstr(out, "usage"));
        return;
    }
    /* Built for this machine's extensions that Haswell lacks (AVX-512, or
     * on an AVX2 machine of a later generation VAES, GFNI, SHA, ...):
     * refused, naming each of them and the way out. */
    assert_int_equal(rc, 1);
    assert_non_null(strstr(out, "HT_MARCH=x86-64-v3"));
    const char *lacks = strstr(out, "this CPU lacks ");
    assert_non_null(lacks);
    for (int i = 0; beyond_haswell[i]; i++)
        if (!strstr(lacks, beyond_haswell[i])) fail_msg("the refusal does not name %s: %s", beyond_haswell[i], lacks);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_qemu_is_there),
        cmocka_unit_test(test_no_avx2_is_one_sentence),
        cmocka_unit_test(test_avx2_cpu),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
