/* The CPU's kernels: ht_NAME for each entry NAME of the kernel table that
 * computes or moves bytes (include/hypertrain/kernels.h, HT_KERNEL_ENTRIES,
 * says what each does). ops.c holds the decoder's elementwise and reduction
 * kernels, attention.c the attention, moe.c the sparse blocks, optim.c the
 * optimizers' passes, gemm.c the products, backend.c the table and the
 * moving of bytes; convert and round_to are base's (base.h). Everything
 * computes in FP32; OpenMP splits rows across threads. */
#ifndef HT_KERNELS_CPU_OPS_H
#define HT_KERNELS_CPU_OPS_H

#include "hypertrain/base.h"
#include "hypertrain/kernels.h"

#define HT_CPU_DECLARE(kind, type, name, params, args, arrays) HT_CPU_DECLARE_##kind(type, name, params)
#define HT_CPU_DECLARE_OWN(type, name, params) /* the table's own: backend.c */
#define HT_CPU_DECLARE_SIZE(type, name, params) type ht_##name params;
#define HT_CPU_DECLARE_GEMM HT_CPU_DECLARE_SIZE
#define HT_CPU_DECLARE_RUN HT_CPU_DECLARE_SIZE
#define HT_CPU_DECLARE_GET HT_CPU_DECLARE_SIZE
HT_KERNEL_ENTRIES(HT_CPU_DECLARE)

#endif
