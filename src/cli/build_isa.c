/* The instruction-set extensions this build was compiled to use, read from
 * the compiler's own macros under the build's -march. Data only: no code here
 * runs, so it is safe on any CPU; cpu_check.c compares it with the CPU. */
#include "cli/cpu_check.h"

const char ht_build_isa[] = ""
#ifdef __AVX__
                            " avx"
#endif
#ifdef __AVX2__
                            " avx2"
#endif
#ifdef __FMA__
                            " fma"
#endif
#ifdef __F16C__
                            " f16c"
#endif
#ifdef __BMI__
                            " bmi"
#endif
#ifdef __BMI2__
                            " bmi2"
#endif
#ifdef __LZCNT__
                            " lzcnt"
#endif
#ifdef __MOVBE__
                            " movbe"
#endif
#ifdef __POPCNT__
                            " popcnt"
#endif
#ifdef __PCLMUL__
                            " pclmul"
#endif
#ifdef __AES__
                            " aes"
#endif
#ifdef __SSE4A__
                            " sse4a"
#endif
#ifdef __AVX512F__
                            " avx512f"
#endif
#ifdef __AVX512CD__
                            " avx512cd"
#endif
#ifdef __AVX512BW__
                            " avx512bw"
#endif
#ifdef __AVX512DQ__
                            " avx512dq"
#endif
#ifdef __AVX512VL__
                            " avx512vl"
#endif
#ifdef __AVX512BF16__
                            " avx512bf16"
#endif
#ifdef __AVX512FP16__
                            " avx512fp16"
#endif
#ifdef __AVX512VNNI__
                            " avx512vnni"
#endif
#ifdef __AVX512VBMI__
                            " avx512vbmi"
#endif
#ifdef __AVX512VBMI2__
                            " avx512vbmi2"
#endif
#ifdef __AVX512IFMA__
                            " avx512ifma"
#endif
#ifdef __AVX512BITALG__
                            " avx512bitalg"
#endif
#ifdef __AVX512VPOPCNTDQ__
                            " avx512vpopcntdq"
#endif
#ifdef __AVX512VP2INTERSECT__
                            " avx512vp2intersect"
#endif
#ifdef __AVXVNNI__
                            " avxvnni"
#endif
#ifdef __GFNI__
                            " gfni"
#endif
#ifdef __VAES__
                            " vaes"
#endif
#ifdef __VPCLMULQDQ__
                            " vpclmulqdq"
#endif
#ifdef __SHA__
                            " sha"
#endif
#ifdef __ADX__
                            " adx"
#endif
#ifdef __RDSEED__
                            " rdseed"
#endif
#ifdef __AMX_TILE__
                            " amx-tile"
#endif
#ifdef __AMX_BF16__
                            " amx-bf16"
#endif
#ifdef __AMX_INT8__
                            " amx-int8"
#endif
    ;
