/* WMMA for cuda_emu.h: each lane holds the whole 16 x 16 tile (loads and
 * products done by every lane alike, the store by lane 0), so a fragment's
 * elementwise loop over num_elements touches every element once a lane.
 * Products sum in k order in FP32. */
#ifndef HT_TESTS_EMU_MMA_H
#define HT_TESTS_EMU_MMA_H
#include <type_traits>

namespace nvcuda {
namespace wmma {
struct matrix_a {};
struct matrix_b {};
struct accumulator {};
struct row_major {};
struct col_major {};
enum layout_t { mem_row_major, mem_col_major };
template <typename Use, int M, int N, int K, typename T, typename Layout = void> struct fragment {
    enum { num_elements = 256 };
    float x[256];
};
template <typename Use, typename T, typename Layout>
inline void load_matrix_sync(fragment<Use, 16, 16, 16, T, Layout> &f, const T *p, unsigned ldm) {
    for (int r = 0; r < 16; r++)
        for (int c = 0; c < 16; c++)
            f.x[r * 16 + c] = (float)(std::is_same<Layout, col_major>::value ? p[c * ldm + r] : p[r * ldm + c]);
}
inline void load_matrix_sync(fragment<accumulator, 16, 16, 16, float> &f, const float *p, unsigned ldm, layout_t l) {
    for (int r = 0; r < 16; r++)
        for (int c = 0; c < 16; c++) f.x[r * 16 + c] = l == mem_col_major ? p[c * ldm + r] : p[r * ldm + c];
}
inline void store_matrix_sync(float *p, const fragment<accumulator, 16, 16, 16, float> &f, unsigned ldm, layout_t l) {
    if (threadIdx.x % 32 != 0) return;
    for (int r = 0; r < 16; r++)
        for (int c = 0; c < 16; c++) (l == mem_col_major ? p[c * ldm + r] : p[r * ldm + c]) = f.x[r * 16 + c];
}
inline void fill_fragment(fragment<accumulator, 16, 16, 16, float> &f, float v) {
    for (int e = 0; e < 256; e++) f.x[e] = v;
}
template <typename T, typename LA, typename LB>
inline void mma_sync(fragment<accumulator, 16, 16, 16, float> &d, const fragment<matrix_a, 16, 16, 16, T, LA> &a,
                     const fragment<matrix_b, 16, 16, 16, T, LB> &b,
                     const fragment<accumulator, 16, 16, 16, float> &c) {
    float out[256];
    for (int r = 0; r < 16; r++)
        for (int n = 0; n < 16; n++) {
            float s = 0.0f;
            for (int k = 0; k < 16; k++) s += a.x[r * 16 + k] * b.x[k * 16 + n];
            out[r * 16 + n] = c.x[r * 16 + n] + s;
        }
    for (int e = 0; e < 256; e++) d.x[e] = out[e];
}
} // namespace wmma
} // namespace nvcuda
#endif
