/* The CPU check that runs before main: the engine needs AVX2 and FMA, and a
 * binary compiled for more (-march=native elsewhere) needs all of it. */
#ifndef HT_CLI_CPU_CHECK_H
#define HT_CLI_CPU_CHECK_H

/* Space-separated extensions the build uses, each with a leading space (build_isa.c). */
extern const char ht_build_isa[];

#endif
