// int4 (group 32, fp16 scale + offset) weights x int8 activations (one scale per 32 values), AVX512-VNNI.
// See cpu_q4.py.
//
// Weights [N, K], K a multiple of 128: codes 0..15 packed per 128-weight block (4 groups) into 64 bytes: byte
// 16 g + j holds weight j of group g (low nibble) and weight 16 + j (high nibble), so one 64-byte load and two
// masks give two vectors whose 32-bit lanes 4 g .. 4 g + 3 both belong to group g: their VNNI dot products add up
// in one int32 vector before the group scales; scale and offset fp16 [N, K/32] (w = q * scale + offset). The
// activations come in the same order (cpu_q4.py permutes them). Activations: symmetric int8 codes xq [M, K] with one scale per
// row (applied by the caller) and isum [M, K/32] = the sum of each group's codes (exact in float).
// y[m, n] = sum_g scale[n, g] * dot_g(q, xq) + offset[n, g] * isum[m, g], the dot products in int32 (VNNI),
// accumulated in 16 float lanes in a fixed order, then a fixed reduction. Each output is computed by itself,
// whatever M is: a row's result does not depend on the other rows (batch invariance).
#include <immintrin.h>
#include <stdint.h>

#define INLINE static inline __attribute__((always_inline))

INLINE void row_block(const uint8_t *wr, const uint16_t *sr, const uint16_t *orow, int64_t k, const int8_t *xq,
                      const float *xsl, const float *isum, const int mb, float *out /* [mb] */, const __m512i *idx) {
    const int64_t blocks = k / 128, groups = k / 32;
    const __m512i low = _mm512_set1_epi8(0x0F);
    __m512 acc[8], off[8];
    for (int i = 0; i < mb; i++) { acc[i] = _mm512_setzero_ps(); off[i] = _mm512_setzero_ps(); }
    for (int64_t b0 = 0; b0 < blocks; b0 += 4) {  // 4 blocks = 16 groups: one vector of scales and offsets
        const int nb = (int)(blocks - b0 < 4 ? blocks - b0 : 4);
        __m512 sw, ow;
        if (nb == 4) {
            sw = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(sr + 4 * b0)));
            ow = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(orow + 4 * b0)));
        } else {
            const __mmask16 mk = (__mmask16)((1u << (4 * nb)) - 1);
            sw = _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(mk, sr + 4 * b0));
            ow = _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(mk, orow + 4 * b0));
        }
        for (int i = 0; i < mb; i++) {
            const float *ig = isum + i * groups + 4 * b0;
            const __m512 iv = nb == 4 ? _mm512_loadu_ps(ig)
                                      : _mm512_maskz_loadu_ps((__mmask16)((1u << (4 * nb)) - 1), ig);
            off[i] = _mm512_fmadd_ps(ow, iv, off[i]);
        }
        for (int c = 0; c < nb; c++) {
            const int64_t bl = b0 + c;
            const __m512i v = _mm512_loadu_si512(wr + bl * 64);
            const __m512i lo = _mm512_and_si512(v, low);
            const __m512i hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
            const __m512 sc = _mm512_permutexvar_ps(idx[c], sw);  // lanes 4 g .. 4 g + 3: group 4 c + g
            for (int i = 0; i < mb; i++) {
                const int8_t *xb = xq + i * k + bl * 128;
                __m512i d = _mm512_dpbusd_epi32(_mm512_setzero_si512(), lo, _mm512_loadu_si512(xb));
                d = _mm512_dpbusd_epi32(d, hi, _mm512_loadu_si512(xb + 64));
                const __m512 s = _mm512_mul_ps(sc, _mm512_loadu_ps(xsl + (i * blocks + bl) * 16));
                acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(d), s, acc[i]);
            }
        }
    }
    for (int i = 0; i < mb; i++) out[i] = _mm512_reduce_add_ps(acc[i]) + _mm512_reduce_add_ps(off[i]);
}

// y [M, N] (row stride N); rows n0 .. n1 - 1 of the weights.
void q4_gemm(const uint8_t *w, const uint16_t *scale, const uint16_t *offset, int64_t n, int64_t k,
             const int8_t *xq, const float *xs_lanes, const float *isum, int64_t m, float *y, int64_t n0, int64_t n1) {
    const int64_t groups = k / 32;
    __m512i idx[4];
    for (int c = 0; c < 4; c++) {  // block c of 4: its groups 4 c .. 4 c + 3, four lanes each
        int v[16];
        for (int l = 0; l < 16; l++) v[l] = 4 * c + l / 4;
        idx[c] = _mm512_loadu_si512(v);
    }
    float out[8];
    for (int64_t r = n0; r < n1; r++) {
        const uint8_t *wr = w + r * (k / 2);
        const uint16_t *sr = scale + r * groups, *orow = offset + r * groups;
        for (int64_t m0 = 0; m0 < m; m0 += 8) {
            const int mb = (int)(m - m0 < 8 ? m - m0 : 8);
            const int8_t *xb = xq + m0 * k;
            const float *ib = isum + m0 * groups;
            const float *xl = xs_lanes + m0 * (k / 128) * 16;
            switch (mb) {  // constant row counts: the accumulators stay in registers
                case 1: row_block(wr, sr, orow, k, xb, xl, ib, 1, out, idx); break;
                case 2: row_block(wr, sr, orow, k, xb, xl, ib, 2, out, idx); break;
                case 3: row_block(wr, sr, orow, k, xb, xl, ib, 3, out, idx); break;
                case 4: row_block(wr, sr, orow, k, xb, xl, ib, 4, out, idx); break;
                case 5: row_block(wr, sr, orow, k, xb, xl, ib, 5, out, idx); break;
                case 6: row_block(wr, sr, orow, k, xb, xl, ib, 6, out, idx); break;
                case 7: row_block(wr, sr, orow, k, xb, xl, ib, 7, out, idx); break;
                default: row_block(wr, sr, orow, k, xb, xl, ib, 8, out, idx); break;
            }
            for (int i = 0; i < mb; i++) y[(m0 + i) * n + r] = out[i];
        }
    }
}
