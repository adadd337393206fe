/* The tensor-core attention kernels of kernels/cuda/flash.cu, run on the
 * host (tests/emu/: a block's threads as host threads, WMMA as whole 16 x 16
 * tiles) against the CPU's attention: forward (O, lse, QK-clip's per-head
 * max) and backward (dQ, dK, dV) in bf16 and f16, on the head dims the
 * kernels take (32, 64, 128, Multi-Latent Attention's 192 / 128), grouped
 * queries, several and ragged tiles, blocks of keys at other positions. The
 * bounds are test_kernels' for a backend: 8u of the largest value apart
 * (each within 4u of the FP32 attention on the same rounded operands, a P
 * or dS whose rounding flips with the summation order or the tile's
 * running max), 1e-5 for lse and the maximum. What runs here is the
 * kernels' logic (indexing, masks, barriers, roundings); the GPU's own
 * summation order inside a product is what test_kernels checks there. */
#include "emu/cuda_emu.h"
#include "emu/mma.h"
#define HT_CUDA_EMU 1
#include "kernels/cuda/flash.cu"

#include <cstdio>
#include <cstdlib>
#include <omp.h>

alignas(128) unsigned char fa_shared[232448]; /* an H100's or H200's most a block may have */

static int failures;

static std::vector<float> normal(size_t n, uint64_t seed, float stdev) {
    std::vector<float> x(n);
    ht_rng rng;
    ht_rng_seed(&rng, seed);
    for (auto &e : x) e = stdev * (float)ht_rng_normal(&rng);
    return x;
}

/* max |got - want| / max |want| (inf: a NaN, or a mismatched infinity) */
static double apart(const std::vector<float> &got, const std::vector<float> &want, bool infinities) {
    double num = 0, den = 0;
    for (size_t i = 0; i < want.size(); i++) {
        if (infinities && (std::isinf(want[i]) || std::isinf(got[i]))) {
            if (got[i] != want[i]) return INFINITY;
            continue;
        }
        num = std::fmax(num, std::isnan(got[i]) ? INFINITY : std::fabs((double)got[i] - want[i]));
        den = std::fmax(den, std::fabs((double)want[i]));
    }
    return den > 0 ? num / den : num;
}

static void check(const char *what, const std::vector<float> &got, const std::vector<float> &want, double bound,
                  bool infinities = false) {
    const double e = apart(got, want, infinities);
    if (!(e <= bound)) {
        printf("  FAIL %s: %.3g apart (bound %g)\n", what, e, bound);
        failures++;
    }
}

template <typename T16, int DK, int DV> static void check_shape(ht_attention_shape a, ht_dtype dtype) {
    const int64_t Tk = a.Tk > 0 ? a.Tk : a.T, nq = a.B * a.T * a.H * DK, nk = a.B * Tk * a.KV * DK;
    const int64_t nv = a.B * Tk * a.KV * DV, no = a.B * a.T * a.H * DV, nl = a.B * a.H * a.T;
    a.Dk = DK, a.Dv = DV;
    auto q = normal(nq, 131 + a.T, 1.5f), k = normal(nk, 132 + a.T, 1.5f), v = normal(nv, 133 + a.T, 1.0f);
    auto dout = normal(no, 134 + a.T, 1.0f);
    std::vector<float> out(no), lse(nl), hmax(a.B * a.H), dq(nq), dk(nk), dv(nv);
    const ht_kernel_ops *cpu = ht_kernels_cpu();
    const int64_t longest = a.T > Tk ? a.T : Tk;
    std::vector<float> work((size_t)omp_get_max_threads() * cpu->attention_workspace_floats(longest, DK, DV));
    cpu->attention_forward(out.data(), lse.data(), hmax.data(), q.data(), k.data(), v.data(), &a, dtype, work.data());
    cpu->attention_backward(dq.data(), dk.data(), dv.data(), dout.data(), out.data(), lse.data(), q.data(), k.data(),
                            v.data(), &a, dtype, work.data());
    const double u = dtype == HT_DTYPE_BF16 ? 1.0 / 256 : 1.0 / 2048;

    std::vector<float> got_out(no, NAN), got_lse(nl, NAN), got_hmax(a.B * a.H, -INFINITY), got_dq(nq, NAN),
        got_dk(nk, NAN), got_dv(nv, NAN);
    const emu::dim3v qgrid = {(unsigned)((a.T + FA_ROWS - 1) / FA_ROWS), (unsigned)a.H, (unsigned)a.B};
    const emu::dim3v kgrid = {(unsigned)((Tk + FA_ROWS - 1) / FA_ROWS), (unsigned)a.KV, (unsigned)a.B};
    const size_t fbytes = fa_forward_smem<T16, DK, DV>(0).bytes, bbytes = fa_backward_smem<T16, DK, DV>(0).bytes;
    if (fbytes > sizeof(fa_shared) || bbytes > sizeof(fa_shared)) {
        printf("  FAIL shared memory: forward %zu, backward %zu bytes; at most %zu\n", fbytes, bbytes,
               sizeof(fa_shared));
        failures++;
        return;
    }
    emu::launch(qgrid, FA_THREADS, fa_shared, fbytes, [&] {
        fa_forward_kernel<T16, DK, DV>(got_out.data(), got_lse.data(), got_hmax.data(), q.data(), k.data(), v.data(),
                                       a);
    });
    /* backward from the CPU's O and lse: the gradients' own differences */
    emu::launch(qgrid, FA_THREADS, fa_shared, bbytes, [&] {
        fa_dq_kernel<T16, DK, DV>(got_dq.data(), dout.data(), out.data(), lse.data(), q.data(), k.data(), v.data(), a);
    });
    emu::launch(kgrid, FA_THREADS, fa_shared, bbytes, [&] {
        fa_dkv_kernel<T16, DK, DV>(got_dk.data(), got_dv.data(), dout.data(), out.data(), lse.data(), q.data(),
                                   k.data(), v.data(), a);
    });
    const int failed = failures;
    check("out", got_out, out, 8 * u);
    check("lse", got_lse, lse, 1e-5, true);
    check("head_max", got_hmax, hmax, 1e-5);
    check("dq", got_dq, dq, 8 * u);
    check("dk", got_dk, dk, 8 * u);
    check("dv", got_dv, dv, 8 * u);
    printf("%s %s B%lld T%lld H%lld KV%lld Dk%d Dv%d Tk%lld q0 %lld k0 %lld: out %.2g, lse %.2g, dq %.2g, dk %.2g, "
           "dv %.2g (bound %.2g); shared %zu + %zu bytes\n",
           failures == failed ? "ok  " : "FAIL", ht_dtype_name(dtype), (long long)a.B, (long long)a.T, (long long)a.H,
           (long long)a.KV, DK, DV, (long long)Tk, (long long)a.q0, (long long)a.k0, apart(got_out, out, false),
           apart(got_lse, lse, true), apart(got_dq, dq, false), apart(got_dk, dk, false), apart(got_dv, dv, false),
           8 * u, fbytes, bbytes);
}

template <typename T16> static void check_all(ht_dtype dtype) {
    check_shape<T16, 64, 64>(
        {.B = 2, .T = 100, .H = 4, .KV = 2, .Dk = 0, .Dv = 0, .scale = 0.125f, .Tk = 0, .q0 = 0, .k0 = 0}, dtype);
    check_shape<T16, 64, 64>(
        {.B = 1, .T = 130, .H = 2, .KV = 2, .Dk = 0, .Dv = 0, .scale = 0.125f, .Tk = 0, .q0 = 0, .k0 = 0}, dtype);
    check_shape<T16, 128, 128>(
        {.B = 1, .T = 70, .H = 2, .KV = 1, .Dk = 0, .Dv = 0, .scale = 0.0883883f, .Tk = 0, .q0 = 0, .k0 = 0}, dtype);
    check_shape<T16, 192, 128>(
        {.B = 1, .T = 45, .H = 2, .KV = 1, .Dk = 0, .Dv = 0, .scale = 0.1f, .Tk = 0, .q0 = 0, .k0 = 0}, dtype);
    check_shape<T16, 32, 32>(
        {.B = 2, .T = 64, .H = 2, .KV = 2, .Dk = 0, .Dv = 0, .scale = 0.17f, .Tk = 96, .q0 = 64, .k0 = 32}, dtype);
    check_shape<T16, 32, 32>(
        {.B = 1, .T = 64, .H = 2, .KV = 1, .Dk = 0, .Dv = 0, .scale = 0.17f, .Tk = 64, .q0 = 0, .k0 = 40}, dtype);
    check_shape<T16, 32, 32>(
        {.B = 1, .T = 70, .H = 3, .KV = 1, .Dk = 0, .Dv = 0, .scale = 0.17f, .Tk = 150, .q0 = 200, .k0 = 10}, dtype);
}

int main() {
    check_all<__nv_bfloat16>(HT_DTYPE_BF16);
    check_all<__half>(HT_DTYPE_F16);
    if (failures) printf("%d check(s) failed\n", failures);
    return failures ? 1 : 0;
}
