// int4 (group 32, fp16 scale + offset) weights x int8 activations (one scale per 32 values), AVX512-VNNI, or AVX2
// on CPUs without it (the #else branches below; same layout, same integer dot products). See cpu_q4.py.
//
// Weights [N, K], K a multiple of 32, stored in row groups of 4 output rows (N padded to a multiple of 4 with zero
// rows), so that one pass reads one sequential stream and computes 4 outputs per activation row. A row's groups
// of 32 weights are taken 16 at a time (a chunk; the last one may hold ng < 16 groups). Per row group and chunk:
//   uint16 scale[4][16], uint16 offset[4][16]   fp16 (w = q * scale + offset); entries past ng are zero
//   uint8  codes[4 rows][4 loads][ng][4]       load j, group l, byte t: weight 8 j + t of group l (low nibble)
//                                               and weight 8 j + 4 + t (high nibble)
// so that the 32-bit lane l of every VNNI dot product belongs to group l: the 8 dot products of a chunk (4 loads x
// low / high nibbles) add up in one int32 vector whose lane l is group l's whole dot product, then one convert
// and one multiply-add with the 16 group scales (no per-block permutes, 2.5 float ops per 512 weights).
// Activations (q4_quant_act): symmetric int8 codes with one scale per 32 values, per row [chunks][8 pieces][16
// groups][4] (piece p, group l: values 4 p .. 4 p + 3 of group l; zero padded), xs [M, chunks * 16] the group
// scales, isum [M, chunks * 16] = scale * the sum of each group's codes (both zero padded).
// y[m, n] = sum_g scale[n, g] * xs[m, g] * dot_g(q, xq) + offset[n, g] * isum[m, g]: the dot products in int32,
// accumulated in 16 float lanes in a fixed order (chunk by chunk), then a fixed reduction. Each output's sequence
// of operations is the same whatever M and however the row groups are split over threads: a row's result does not
// depend on the other rows (batch invariance).
#include <immintrin.h>
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#ifndef KB_CHUNKS
#define KB_CHUNKS 2  // AVX2 group_rows: chunks of K per block (2 x 512 bytes of each activation row; measured below)
#endif
#ifndef KB_FROM
#define KB_FROM 4  // ... for rows of more than this many chunks (K > 2048)
#endif
#ifndef PFD
#define PFD 4096  // software prefetch distance in bytes (measured: 2-4 KB ahead streams best at 1 and 2 threads)
#endif
#define INLINE static inline __attribute__((always_inline))
// activation rows per pass over a row group (the group's bytes stay in L1/L2 between passes)
#ifdef __AVX512VNNI__
#define MB 4
#else
#define MB 8
#endif

static int64_t chunks_of(int64_t k) { return (k / 32 + 15) / 16; }

// bytes of one row group of 4 rows: a 256-byte header per chunk and 16 bytes per group and row
int64_t q4_group_bytes(int64_t k) { return chunks_of(k) * 256 + (k / 32) * 64; }

INLINE float hsum8(__m256 a) {  // fixed order
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

#ifdef __AVX512VNNI__
// [a0 .. a3] -> (sum of a0's lanes, .., sum of a3's lanes), in a fixed order
INLINE __m128 reduce4(__m512 a0, __m512 a1, __m512 a2, __m512 a3) {
    const __m512 s01 = _mm512_add_ps(_mm512_unpacklo_ps(a0, a1), _mm512_unpackhi_ps(a0, a1));
    const __m512 s23 = _mm512_add_ps(_mm512_unpacklo_ps(a2, a3), _mm512_unpackhi_ps(a2, a3));
    const __m512 t = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(s01), _mm512_castps_pd(s23))),
                                   _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(s01), _mm512_castps_pd(s23))));
    const __m256 h = _mm256_add_ps(_mm512_castps512_ps256(t), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(t), 1)));
    return _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
}

// weight row r's codes in a chunk of ng groups (4 loads), split into low and high nibbles
INLINE void unpack_row(const uint8_t *cp, __mmask16 mk, int r, int ng, __m512i low, __m512i lo[4], __m512i hi[4]) {
    for (int j = 0; j < 4; j++) {
        const __m512i v = _mm512_maskz_loadu_epi32(mk, cp + (r * 4 + j) * 4 * ng);
        lo[j] = _mm512_and_si512(v, low);
        hi[j] = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
    }
}

// acc + one chunk of (weight row, activation row): lane l of d0 + d1 is group 16 c + l's int32 dot product
INLINE __m512 fold_dots(__m512 acc, __m512i d0, __m512i d1, __m512 sw, __m512 xs, __m512 ow, __m512 is) {
    const __m512 dot = _mm512_cvtepi32_ps(_mm512_add_epi32(d0, d1));
    acc = _mm512_fmadd_ps(dot, _mm512_mul_ps(sw, xs), acc);
    return _mm512_fmadd_ps(ow, is, acc);
}

// one row group (4 weight rows) x mb activation rows -> out[i * 4 + r]
INLINE void group_rows(const uint8_t *g, int64_t k, const int8_t *xq, const float *xs, const float *isum,
                       const int mb, float *out) {
    const int64_t groups = k / 32, chunks = chunks_of(k), astride = chunks * 512, sstride = chunks * 16;
    const __m512i low = _mm512_set1_epi8(0x0F);
    __m512 acc[4][4];
    for (int r = 0; r < 4; r++)
        for (int i = 0; i < mb; i++) acc[r][i] = _mm512_setzero_ps();
    const uint8_t *p = g;
    for (int64_t c = 0; c < chunks; c++) {
        const int ng = (int)(groups - 16 * c < 16 ? groups - 16 * c : 16);
        const __mmask16 mk = (__mmask16)((1u << ng) - 1);
        const uint16_t *hdr = (const uint16_t *)p;
        const uint8_t *cp = p + 256;
        for (int l = 0; l < 256 + 64 * ng; l += 64) _mm_prefetch((const char *)(p + PFD + l), _MM_HINT_T0);
        __m512 xsv[4], isv[4];
        for (int i = 0; i < mb; i++) {
            xsv[i] = _mm512_loadu_ps(xs + i * sstride + 16 * c);
            isv[i] = _mm512_loadu_ps(isum + i * sstride + 16 * c);
        }
        if (mb == 2) {  // two activation rows: two weight rows at a time share each activation load (one load, two
            // dot products; session 49, gate/up 0.86-0.91x the time). From 3 rows the codes of two weight rows, the
            // activations and the 4 x mb accumulators no longer fit the 32 registers: the loop below.
            for (int r = 0; r < 4; r += 2) {
                __m512i lo[2][4], hi[2][4];
                for (int u = 0; u < 2; u++) unpack_row(cp, mk, r + u, ng, low, lo[u], hi[u]);
                for (int i = 0; i < 2; i++) {
                    const int8_t *xa = xq + i * astride + c * 512;
                    __m512i d0[2], d1[2];
                    for (int j = 0; j < 4; j++) {
                        const __m512i a0 = _mm512_loadu_si512(xa + 128 * j), a1 = _mm512_loadu_si512(xa + 128 * j + 64);
                        for (int u = 0; u < 2; u++) {
                            d0[u] = _mm512_dpbusd_epi32(j ? d0[u] : _mm512_setzero_si512(), lo[u][j], a0);
                            d1[u] = _mm512_dpbusd_epi32(j ? d1[u] : _mm512_setzero_si512(), hi[u][j], a1);
                        }
                    }
                    for (int u = 0; u < 2; u++) {  // (the same integers and float operations, in the same order, as below)
                        const __m512 sw = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(hdr + 16 * (r + u))));
                        const __m512 ow = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(hdr + 64 + 16 * (r + u))));
                        acc[r + u][i] = fold_dots(acc[r + u][i], d0[u], d1[u], sw, xsv[i], ow, isv[i]);
                    }
                }
            }
            p = cp + 64 * ng;
            continue;
        }
        for (int r = 0; r < 4; r++) {
            const __m512 sw = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(hdr + 16 * r)));
            const __m512 ow = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(hdr + 64 + 16 * r)));
            __m512i lo[4], hi[4];
            unpack_row(cp, mk, r, ng, low, lo, hi);
            for (int i = 0; i < mb; i++) {
                const int8_t *xa = xq + i * astride + c * 512;
                __m512i d0 = _mm512_dpbusd_epi32(_mm512_setzero_si512(), lo[0], _mm512_loadu_si512(xa));
                __m512i d1 = _mm512_dpbusd_epi32(_mm512_setzero_si512(), hi[0], _mm512_loadu_si512(xa + 64));
                for (int j = 1; j < 4; j++) {
                    d0 = _mm512_dpbusd_epi32(d0, lo[j], _mm512_loadu_si512(xa + 128 * j));
                    d1 = _mm512_dpbusd_epi32(d1, hi[j], _mm512_loadu_si512(xa + 128 * j + 64));
                }
                acc[r][i] = fold_dots(acc[r][i], d0, d1, sw, xsv[i], ow, isv[i]);
            }
        }
        p = cp + 64 * ng;
    }
    for (int i = 0; i < mb; i++) _mm_storeu_ps(out + 4 * i, reduce4(acc[0][i], acc[1][i], acc[2][i], acc[3][i]));
}

#else  // AVX2 + FMA + F16C (AMD Zen 1-3, Intel Haswell .. Ice Lake client): the same layout, 8 groups per vector
//
// A chunk's 16 groups are two halves of 8 (32-bit lane l of half h: group 8 h + l). VNNI's u8 x s8 dot product of
// 4 bytes per lane is maddubs (u8 x s8 pairs -> int16) then madd with ones (int16 pairs -> int32). A pair sum is at
// most 2 * 15 * 127 = 3810 in size, so the 8 products of a half (4 loads x low / high nibbles) add up in int16 (at
// most 30480 < 2^15) before the one widening madd: the int32 dot products are exactly VNNI's. Rows of the group
// are taken one at a time (r outer, group_rows; 1-2 activation rows: group_rows_few, r inner), so one row's mb
// int16 sums and float accumulators fit the 16 ymm registers; the group's bytes (<= 23 KB at K = 8960) stay in
// L1/L2 between rows. Per output the order of the float operations is
// fixed by the output alone (batch invariance); it differs from the AVX-512 build's (another reduction tree).

// 1-2 activation rows: chunk by chunk with the 4 rows inside (the group's bytes read in order, as the AVX-512 build
// does), 4 x mb accumulators. Per output the same float operations in the same order as group_rows below, so a
// row's result is the same whichever of the two computes it (measured: 10-25 % faster than group_rows at 1-2 rows,
// slower at 4, where its 16 accumulators spill).
INLINE void group_rows_few(const uint8_t *g, int64_t k, const int8_t *xq, const float *xs, const float *isum,
                           const int mb, float *out) {
    const int64_t groups = k / 32, chunks = chunks_of(k), astride = chunks * 512, sstride = chunks * 16;
    const __m256i low = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
    const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    __m256 acc[4][2];
    for (int r = 0; r < 4; r++)
        for (int i = 0; i < mb; i++) acc[r][i] = _mm256_setzero_ps();
    const uint8_t *p = g;
    for (int64_t c = 0; c < chunks; c++) {
        const int ng = (int)(groups - 16 * c < 16 ? groups - 16 * c : 16);
        const uint16_t *hdr = (const uint16_t *)p;
        const uint8_t *cp = p + 256;
        for (int l = 0; l < 256 + 64 * ng; l += 64) _mm_prefetch((const char *)(p + PFD + l), _MM_HINT_T0);
        for (int h = 0; h < 2 && 8 * h < ng; h++) {
            const __m256i mk = _mm256_cmpgt_epi32(_mm256_set1_epi32(ng - 8 * h), lane);
            __m256 xsv[2], isv[2];
            for (int i = 0; i < mb; i++) {
                xsv[i] = _mm256_loadu_ps(xs + i * sstride + 16 * c + 8 * h);
                isv[i] = _mm256_loadu_ps(isum + i * sstride + 16 * c + 8 * h);
            }
            for (int r = 0; r < 4; r++) {
                const __m256 sw = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(hdr + 16 * r + 8 * h)));
                const __m256 ow = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(hdr + 64 + 16 * r + 8 * h)));
                __m256i s16[2];
                for (int j = 0; j < 4; j++) {
                    const int *src = (const int *)(cp + (r * 4 + j) * 4 * ng + 32 * h);
                    const __m256i v = ng == 16 ? _mm256_loadu_si256((const __m256i *)src) : _mm256_maskload_epi32(src, mk);
                    const __m256i lo = _mm256_and_si256(v, low), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
                    for (int i = 0; i < mb; i++) {
                        const int8_t *xa = xq + i * astride + c * 512 + 32 * h + 128 * j;
                        const __m256i t = _mm256_add_epi16(_mm256_maddubs_epi16(lo, _mm256_loadu_si256((const __m256i *)xa)),
                                                           _mm256_maddubs_epi16(hi, _mm256_loadu_si256((const __m256i *)(xa + 64))));
                        s16[i] = j == 0 ? t : _mm256_add_epi16(s16[i], t);
                    }
                }
                for (int i = 0; i < mb; i++) {
                    const __m256 dot = _mm256_cvtepi32_ps(_mm256_madd_epi16(s16[i], ones));
                    acc[r][i] = _mm256_fmadd_ps(dot, _mm256_mul_ps(sw, xsv[i]), acc[r][i]);
                    acc[r][i] = _mm256_fmadd_ps(ow, isv[i], acc[r][i]);
                }
            }
        }
        p = cp + 64 * ng;
    }
    for (int r = 0; r < 4; r++)
        for (int i = 0; i < mb; i++) out[4 * i + r] = hsum8(acc[r][i]);
}

// one row group (4 weight rows) x mb (<= 8) activation rows -> out[i * 4 + r]. Per weight row and 8 groups: each of
// the 4 code loads is unpacked once and taken by all mb rows (their int16 sums in registers), then the mb float
// updates (measured on the Zen 3: 15-25 % faster at 3-8 rows than unpacking all 8 code vectors first; 8 rows a pass
// rather than 4 + 4 or 4 + 1 passes). K is taken in blocks of KB_CHUNKS chunks, all 4 weight rows per block, so the
// activations' slice of a block (mb x KB_CHUNKS x 512 bytes) stays in L1 while the 4 rows read it: at K = 8960 the
// whole rows (8 x 9 KB) did not fit and each weight row read them again from L2. The float operations per output
// are the same, in the same order (the accumulators wait in `kept` between blocks): the same bits.
// weight row r of a row group, chunks c0 .. c1 - 1 (c0 at byte offset c0 * 1280: every chunk before the last holds
// 16 groups), into the mb accumulators. Each of the 4 row passes prefetches every 4th line PFD ahead (pass r lines
// r, r + 4, ..), so the requests run through the whole product; when only pass 0 issued them (before session 60)
// the memory sat idle during passes 1-3: on a Zen 2 a 3-token forward of the 1.5B took 0.81x the time after the
// change, 4 tokens 0.86x (docs/quantization.md, session 60). Not in q8_group_rows, whose passes run whole row
// groups: spread there, pass 0 left most of its lines to demand misses and 3-5 rows took 1.10-1.17x the time.
INLINE void row_chunks(const uint8_t *g, int64_t k, const int8_t *xq, const float *xs, const float *isum,
                       const int mb, const int r, const int64_t c0, const int64_t c1, __m256 *acc) {
    const int64_t groups = k / 32, chunks = chunks_of(k), astride = chunks * 512, sstride = chunks * 16;
    const __m256i low = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
    const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    const uint8_t *p = g + c0 * (256 + 64 * 16);
    for (int64_t c = c0; c < c1; c++) {
        const int ng = (int)(groups - 16 * c < 16 ? groups - 16 * c : 16);
        const uint16_t *hdr = (const uint16_t *)p;
        const uint8_t *cp = p + 256;
        for (int l = 64 * r; l < 256 + 64 * ng; l += 256) _mm_prefetch((const char *)(p + PFD + l), _MM_HINT_T0);
        for (int h = 0; h < 2 && 8 * h < ng; h++) {
            const __m256i mk = _mm256_cmpgt_epi32(_mm256_set1_epi32(ng - 8 * h), lane);
            const int8_t *xa = xq + c * 512 + 32 * h;
            __m256i s16[MB];
            for (int j = 0; j < 4; j++) {
                const int *src = (const int *)(cp + (r * 4 + j) * 4 * ng + 32 * h);
                const __m256i v = ng - 8 * h >= 8 ? _mm256_loadu_si256((const __m256i *)src) : _mm256_maskload_epi32(src, mk);
                const __m256i lo = _mm256_and_si256(v, low), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
                for (int i = 0; i < mb; i++) {
                    const int8_t *xi = xa + i * astride + 128 * j;
                    const __m256i t = _mm256_add_epi16(_mm256_maddubs_epi16(lo, _mm256_loadu_si256((const __m256i *)xi)),
                                                       _mm256_maddubs_epi16(hi, _mm256_loadu_si256((const __m256i *)(xi + 64))));
                    s16[i] = j == 0 ? t : _mm256_add_epi16(s16[i], t);
                }
            }
            const __m256 sw = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(hdr + 16 * r + 8 * h)));
            const __m256 ow = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(hdr + 64 + 16 * r + 8 * h)));
            for (int i = 0; i < mb; i++) {
                const __m256 dot = _mm256_cvtepi32_ps(_mm256_madd_epi16(s16[i], ones));  // lane l: group 16 c + 8 h + l
                const int64_t so = i * sstride + 16 * c + 8 * h;
                acc[i] = _mm256_fmadd_ps(dot, _mm256_mul_ps(sw, _mm256_loadu_ps(xs + so)), acc[i]);
                acc[i] = _mm256_fmadd_ps(ow, _mm256_loadu_ps(isum + so), acc[i]);
            }
        }
        p = cp + 64 * ng;
    }
}

INLINE void group_rows(const uint8_t *g, int64_t k, const int8_t *xq, const float *xs, const float *isum,
                       const int mb, float *out) {
    const int64_t chunks = chunks_of(k);
    __m256 acc[MB];
    if (chunks <= KB_FROM) {  // short rows: one block, the accumulators never leave the registers
        for (int r = 0; r < 4; r++) {
            for (int i = 0; i < mb; i++) acc[i] = _mm256_setzero_ps();
            row_chunks(g, k, xq, xs, isum, mb, r, 0, chunks, acc);
            for (int i = 0; i < mb; i++) out[4 * i + r] = hsum8(acc[i]);
        }
        return;
    }
    __m256 kept[4][MB];  // the accumulators between blocks
    for (int64_t c0 = 0; c0 < chunks; c0 += KB_CHUNKS) {
        const int64_t c1 = c0 + KB_CHUNKS < chunks ? c0 + KB_CHUNKS : chunks;
        for (int r = 0; r < 4; r++) {
            for (int i = 0; i < mb; i++) acc[i] = c0 ? kept[r][i] : _mm256_setzero_ps();
            row_chunks(g, k, xq, xs, isum, mb, r, c0, c1, acc);
            for (int i = 0; i < mb; i++) kept[r][i] = acc[i];
        }
    }
    for (int r = 0; r < 4; r++)
        for (int i = 0; i < mb; i++) out[4 * i + r] = hsum8(kept[r][i]);
}
#endif


// Where run_groups' code lands matters on a Zen 2: its 1-row loop took 0.96-1.16x the time with the same machine code
// moved in 16-byte steps, best 16 bytes past a 64-byte boundary, and any edit elsewhere in this file moved it
// (docs/quantization.md, session 63). So it is pinned there: in .text.hot (`hot`: ahead of the rest of the code, its
// address no longer follows the size of the functions before it), 64-byte aligned, with 16 bytes of nops put before
// its entry (`patchable_function_entry(16, 16)`: never executed). An edit of run_groups' own loops can move the best
// place; benchmarks/cpu_q4_ab.py --entry-offsets measures the four.
#ifndef RUN_GROUPS_ENTRY
#define RUN_GROUPS_ENTRY 16
#endif
__attribute__((hot, aligned(64), patchable_function_entry(RUN_GROUPS_ENTRY, RUN_GROUPS_ENTRY)))
static void run_groups(const uint8_t *w, int64_t n, int64_t k, const int8_t *xq, const float *xs, const float *isum,
                       int64_t m, float *y, int64_t g0, int64_t g1) {
    const int64_t gbytes = q4_group_bytes(k), astride = chunks_of(k) * 512, sstride = chunks_of(k) * 16;
    float out[4 * MB];
    for (int64_t gi = g0; gi < g1; gi++) {
        const uint8_t *g = w + gi * gbytes;
        for (int64_t m0 = 0; m0 < m; m0 += MB) {
            const int mb = (int)(m - m0 < MB ? m - m0 : MB);
            const int8_t *xb = xq + m0 * astride;
            const float *sb = xs + m0 * sstride, *ib = isum + m0 * sstride;
            switch (mb) {  // constant row counts: the accumulators stay in registers
#ifdef __AVX512VNNI__
                case 1: group_rows(g, k, xb, sb, ib, 1, out); break;
                case 2: group_rows(g, k, xb, sb, ib, 2, out); break;
#else
                case 1: group_rows_few(g, k, xb, sb, ib, 1, out); break;
                case 2: group_rows_few(g, k, xb, sb, ib, 2, out); break;
#endif
                case 3: group_rows(g, k, xb, sb, ib, 3, out); break;
#ifndef __AVX512VNNI__
                case 4: group_rows(g, k, xb, sb, ib, 4, out); break;
                case 5: group_rows(g, k, xb, sb, ib, 5, out); break;
                case 6: group_rows(g, k, xb, sb, ib, 6, out); break;
                case 7: group_rows(g, k, xb, sb, ib, 7, out); break;
                default: group_rows(g, k, xb, sb, ib, 8, out); break;
#else
                default: group_rows(g, k, xb, sb, ib, 4, out); break;
#endif
            }
            for (int i = 0; i < mb; i++)
                for (int r = 0; r < 4 && 4 * gi + r < n; r++) y[(m0 + i) * n + 4 * gi + r] = out[4 * i + r];
        }
    }
}

#ifdef __AMX_INT8__
// ---- AMX (Intel Sapphire Rapids and later): the same products for many activation rows, the same bits ----
// From amx_min_rows rows on (verify trees, batches, prefill) q4_gemm hands the work to q4_gemm_amx. One tile
// product (tdpbsud: int8 activations x the unsigned 4-bit codes) gives, for one group of 32 weights, the int32 dot
// products of 16 activation rows x 16 outputs: exactly the integers group_rows gets from VNNI. Those are then
// scaled and summed in float with the operations group_rows applies per output, in its order: output n's lane
// l (groups l, l + 16, ..: chunk by chunk) takes fma(dot, scale * xs, acc) then fma(offset, isum, acc), and the 16
// lanes meet in reduce4's tree (here the same additions across the 16 lane vectors of 16 outputs: no transposes;
// session 45). So every output is bit-identical whichever path and row count computes it (batch
// invariance holds across the switch; tests/test_quant.py compares the two paths). Per block of 16 outputs the
// codes are re-laid out once into tile order (a 16 x 16 transpose per code load: lane = group -> lane =
// output) and reused by every block of 16 activation rows; activations are re-laid out once per call.
#include <sys/syscall.h>
#include <unistd.h>

static int amx_state = -1;     // -1: not asked yet; 0: the kernel refuses tile data to this process; 1: ready
// activation rows from which q4_gemm takes this path (0: never). 24 on this 2-core Xeon since session 45's kernel
// (the forward of the 1.5B: 0.95x VNNI at 16 rows, 1.03x at 24, 1.14x at 29; docs/quantization.md); 32 in session
// 43, when a 16-core Xeon measured the tiles at 0.72-0.96x VNNI at 16-24 rows with 8-16 threads (the old kernel)
static int amx_min_rows = 24;
static int64_t amx_calls = 0;  // products run on this path (tests)

int q4_amx_ready(void) {
    if (amx_state < 0) amx_state = syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XTILEDATA */) == 0;
    return amx_state;
}
int64_t q4_amx_calls(void) { return amx_calls; }
int q4_amx_min_rows(int rows) {  // sets the threshold when rows >= 0; returns the one in force
    if (rows >= 0) amx_min_rows = rows;
    return amx_min_rows;
}

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} amx_tilecfg;

// tiles 0, 1: C (16 rows x 16 int32); 2, 3: A (16 activation rows x 32 bytes); 4, 5: B (8 rows x 16 outputs x 4 bytes)
static void amx_configure(void) {
    amx_tilecfg cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette = 1;
    for (int t = 0; t < 6; t++) {
        cfg.rows[t] = t >= 4 ? 8 : 16;
        cfg.colsb[t] = t == 2 || t == 3 ? 32 : 64;
    }
    _tile_loadconfig(&cfg);
}

// rows r[0..15] (16 int32 lanes each) -> their transpose, in place
INLINE void transpose16(__m512i *r) {
    __m512i t[16], u[16];
    for (int i = 0; i < 8; i++) {
        t[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
        t[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
    }
    for (int a = 0; a < 4; a++) {  // u[4 a + e], 128-bit lane q: rows 4 a .. 4 a + 3 of column 4 q + e
        u[4 * a] = _mm512_unpacklo_epi64(t[4 * a], t[4 * a + 2]);
        u[4 * a + 1] = _mm512_unpackhi_epi64(t[4 * a], t[4 * a + 2]);
        u[4 * a + 2] = _mm512_unpacklo_epi64(t[4 * a + 1], t[4 * a + 3]);
        u[4 * a + 3] = _mm512_unpackhi_epi64(t[4 * a + 1], t[4 * a + 3]);
    }
    for (int e = 0; e < 4; e++) {
        const __m512i v0 = _mm512_shuffle_i32x4(u[e], u[4 + e], 0x44), v1 = _mm512_shuffle_i32x4(u[e], u[4 + e], 0xEE);
        const __m512i v2 = _mm512_shuffle_i32x4(u[8 + e], u[12 + e], 0x44), v3 = _mm512_shuffle_i32x4(u[8 + e], u[12 + e], 0xEE);
        r[e] = _mm512_shuffle_i32x4(v0, v2, 0x88);
        r[4 + e] = _mm512_shuffle_i32x4(v0, v2, 0xDD);
        r[8 + e] = _mm512_shuffle_i32x4(v1, v3, 0x88);
        r[12 + e] = _mm512_shuffle_i32x4(v1, v3, 0xDD);
    }
}

// the codes, scales and offsets of row groups gi0 .. gi0 + 3 (outputs 16 b .. 16 b + 15; row groups past ng4 read
// as zero) in tile order: bt[g][8 pieces][16 outputs][4 bytes] (piece 2 j: load j's low nibbles, 2 j + 1: its high
// ones), sw / ow [g][16 outputs] float
static void amx_prepare(const uint8_t *w, int64_t ng4, int64_t k, int64_t gi0, uint8_t *bt, float *sw, float *ow) {
    const int64_t groups = k / 32, chunks = chunks_of(k), gbytes = q4_group_bytes(k);
    const __m512i low = _mm512_set1_epi8(0x0F);
    for (int64_t c = 0; c < chunks; c++) {
        const int ng = (int)(groups - 16 * c < 16 ? groups - 16 * c : 16);
        const __mmask16 mk = (__mmask16)((1u << ng) - 1);
        __m512i v[4][16], s[16], o[16];  // [load j][output n], lane = group
        for (int q = 0; q < 4; q++) {
            const int present = gi0 + q < ng4;
            const uint8_t *p = w + (gi0 + q) * gbytes + c * 1280;
            for (int r = 0; r < 4; r++) {
                const int nn = 4 * q + r;
                if (!present) {
                    s[nn] = o[nn] = _mm512_setzero_si512();
                    for (int j = 0; j < 4; j++) v[j][nn] = _mm512_setzero_si512();
                    continue;
                }
                const uint16_t *hdr = (const uint16_t *)p;
                s[nn] = _mm512_castps_si512(_mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(hdr + 16 * r))));
                o[nn] = _mm512_castps_si512(_mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(hdr + 64 + 16 * r))));
                for (int j = 0; j < 4; j++) v[j][nn] = _mm512_maskz_loadu_epi32(mk, p + 256 + (r * 4 + j) * 4 * ng);
            }
        }
        transpose16(s);
        transpose16(o);
        for (int l = 0; l < ng; l++) {
            _mm512_storeu_si512(sw + (16 * c + l) * 16, s[l]);
            _mm512_storeu_si512(ow + (16 * c + l) * 16, o[l]);
        }
        for (int j = 0; j < 4; j++) {  // transposed as loaded (lane = output), then split into nibbles
            transpose16(v[j]);
            for (int l = 0; l < ng; l++) {
                _mm512_store_si512(bt + (16 * c + l) * 512 + (2 * j) * 64, _mm512_and_si512(v[j][l], low));
                _mm512_store_si512(bt + (16 * c + l) * 512 + (2 * j + 1) * 64,
                                   _mm512_and_si512(_mm512_srli_epi16(v[j][l], 4), low));
            }
        }
    }
}

// lanes [row][l][16 outputs] of activation rows m0 .. m0 + MR - 1: per lane l its groups' tile products (l, l + 16
// in tiles 0 and 1, then l + 32, ..), then the VNNI kernel's float operations on them in its order
INLINE void amx_lanes(const int8_t *xa, const uint8_t *bt, const float *sw, const float *ow, const float *xsg,
                      const float *isg, int64_t groups, int64_t mp, int64_t m0, const int MR, int32_t *cbuf,
                      float *lanes) {
    for (int l = 0; l < 16 && l < groups; l++) {
        __m512 acc[16];
        for (int i = 0; i < MR; i++) acc[i] = _mm512_setzero_ps();
        for (int64_t g = l; g < groups; g += 32) {
            const int two = g + 16 < groups;
            _tile_loadd(2, xa + (g * mp + m0) * 32, 32);
            _tile_loadd(4, bt + g * 512, 64);
            _tile_zero(0);
            _tile_dpbsud(0, 2, 4);
            if (two) {
                _tile_loadd(3, xa + ((g + 16) * mp + m0) * 32, 32);
                _tile_loadd(5, bt + (g + 16) * 512, 64);
                _tile_zero(1);
                _tile_dpbsud(1, 3, 5);
            }
            _tile_stored(0, cbuf, 64);
            if (two) _tile_stored(1, cbuf + 256, 64);
            for (int h = 0; h <= two; h++) {
                const int64_t gg = g + 16 * h;
                const __m512 s = _mm512_load_ps(sw + gg * 16), o = _mm512_load_ps(ow + gg * 16);
                const float *xs = xsg + gg * mp + m0, *is = isg + gg * mp + m0;
                const int32_t *cb = cbuf + 256 * h;
                for (int i = 0; i < MR; i++) {
                    const __m512 dot = _mm512_cvtepi32_ps(_mm512_load_si512(cb + 16 * i));
                    acc[i] = _mm512_fmadd_ps(dot, _mm512_mul_ps(s, _mm512_set1_ps(xs[i])), acc[i]);
                    acc[i] = _mm512_fmadd_ps(o, _mm512_set1_ps(is[i]), acc[i]);
                }
            }
        }
        for (int i = 0; i < MR; i++) _mm512_store_ps(lanes + (i * 16 + l) * 16, acc[i]);
    }
}

// y[m, 16 b + n] for m < M and row-group blocks b0 .. b1 - 1 (16 outputs each); xa [groups][mp][32] the activations
// in tile order, xsg / isg [groups][mp] their scales and scaled sums, mp = M rounded up to 16 (zero rows)
// Returns 0 (nothing written) when its buffers cannot be allocated.
static int amx_run_blocks(const uint8_t *w, int64_t n, int64_t k, const int8_t *xa, const float *xsg,
                          const float *isg, int64_t m, int64_t mp, float *y, int64_t b0, int64_t b1) {
    const int64_t groups = k / 32, ng4 = (n + 3) / 4;
    uint8_t *bt = aligned_alloc(64, groups * 512);
    float *sw = aligned_alloc(64, groups * 64), *ow = aligned_alloc(64, groups * 64);
    int32_t *cbuf = aligned_alloc(64, 2 * 1024);
    float *lanes = aligned_alloc(64, 16 * 16 * 16 * 4);  // [activation row][lane l][output]
    if (!bt || !sw || !ow || !cbuf || !lanes) {
        free(bt);
        free(sw);
        free(ow);
        free(cbuf);
        free(lanes);
        return 0;
    }
    amx_configure();
    for (int64_t b = b0; b < b1; b++) {
        amx_prepare(w, ng4, k, 4 * b, bt, sw, ow);
        for (int64_t m0 = 0; m0 < m; m0 += 16) {
            switch (m - m0 < 16 ? (int)(m - m0) : 16) {  // the row count a constant in each copy
#define AMX_ROWS(R) case R: amx_lanes(xa, bt, sw, ow, xsg, isg, groups, mp, m0, R, cbuf, lanes); break;
                AMX_ROWS(1) AMX_ROWS(2) AMX_ROWS(3) AMX_ROWS(4) AMX_ROWS(5) AMX_ROWS(6) AMX_ROWS(7) AMX_ROWS(8)
                AMX_ROWS(9) AMX_ROWS(10) AMX_ROWS(11) AMX_ROWS(12) AMX_ROWS(13) AMX_ROWS(14) AMX_ROWS(15)
                default: amx_lanes(xa, bt, sw, ow, xsg, isg, groups, mp, m0, 16, cbuf, lanes); break;
#undef AMX_ROWS
            }
            // reduce4's tree over each output's 16 lanes, done across the lane vectors for 16 outputs at once
            // (no transposes): lanes 4 q .. 4 q + 3 -> (v0 + v2) + (v1 + v3), then (T0 + T2) + (T1 + T3)
            const int64_t nv = n - 16 * b < 16 ? n - 16 * b : 16;
            for (int i = 0; i < 16 && m0 + i < m; i++) {
                const float *v = lanes + i * 256;
#define LANE(l) ((l) < groups ? _mm512_load_ps(v + 16 * (l)) : _mm512_setzero_ps())
                __m512 t[4];
                for (int q = 0; q < 4; q++)
                    t[q] = _mm512_add_ps(_mm512_add_ps(LANE(4 * q), LANE(4 * q + 2)),
                                         _mm512_add_ps(LANE(4 * q + 1), LANE(4 * q + 3)));
#undef LANE
                _mm512_mask_storeu_ps(y + (m0 + i) * n + 16 * b, (__mmask16)((1u << nv) - 1),
                                      _mm512_add_ps(_mm512_add_ps(t[0], t[2]), _mm512_add_ps(t[1], t[3])));
            }
        }
    }
    _tile_release();
    free(bt);
    free(sw);
    free(ow);
    free(cbuf);
    free(lanes);
    return 1;
}

// Returns 0 (the caller then runs the VNNI path) when a buffer cannot be allocated.
static int q4_gemm_amx(const uint8_t *w, int64_t n, int64_t k, const int8_t *xq, const float *xs, const float *isum,
                       int64_t m, float *y, int threads) {
    const int64_t groups = k / 32, chunks = chunks_of(k), astride = chunks * 512, sstride = chunks * 16;
    const int64_t mp = (m + 15) / 16 * 16, blocks = ((n + 3) / 4 + 3) / 4;
    amx_calls++;
    int8_t *xa = aligned_alloc(64, groups * mp * 32);
    float *xsg = aligned_alloc(64, (groups * mp * 4 + 63) / 64 * 64), *isg = aligned_alloc(64, (groups * mp * 4 + 63) / 64 * 64);
    int ok = xa && xsg && isg;
    if (!ok) goto done;
    // (over the threads too: run by one thread this re-layout held 16 threads back, and the tiles lost to VNNI
    // at 16-64 rows on a 16-core CPU; docs/quantization.md, session 43)
#pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1 && groups * mp >= 1024)
    for (int64_t g = 0; g < groups; g++) {  // row i of group g: its 8 pieces of 4 codes, in order
        const int8_t *src = xq + (g / 16) * 512 + (g % 16) * 4;
        for (int64_t i = 0; i < mp; i++) {
            int8_t *dst = xa + (g * mp + i) * 32;
            if (i < m)
                for (int p = 0; p < 8; p++) memcpy(dst + 4 * p, src + i * astride + p * 64, 4);
            else
                memset(dst, 0, 32);
            xsg[g * mp + i] = i < m ? xs[i * sstride + g] : 0.0f;
            isg[g * mp + i] = i < m ? isum[i * sstride + g] : 0.0f;
        }
    }
    if (threads <= 1 || blocks < 16) {
        ok = amx_run_blocks(w, n, k, xa, xsg, isg, m, mp, y, 0, blocks);
    } else {
#pragma omp parallel num_threads(threads) reduction(&& : ok)
        {
            const int t = omp_get_thread_num(), nt = omp_get_num_threads();
            const int64_t per = (blocks + nt - 1) / nt;
            const int64_t b0 = t * per, b1 = b0 + per < blocks ? b0 + per : blocks;
            if (b0 < b1) ok = amx_run_blocks(w, n, k, xa, xsg, isg, m, mp, y, b0, b1);
        }
    }
done:
    free(xa);
    free(xsg);
    free(isg);
    return ok;
}
#endif


// Activation rows per pass over the weights in a product of many rows (a prefill chunk): about 512 KB of int8
// activations (64 rows at K = 8,960, 336 at 1,536), so that they stay in cache while every output block reads
// them. In one pass a 2,048-row product re-read all of them from memory for each block (down: 18 MB per block).
// Measured (2-core Xeon, 2 threads, session 43): gate_up at 2,048 rows 720 -> ~520 ms (VNNI), 542 -> ~410 (AMX),
// down 285 -> ~231 / 269 -> ~160; no change at 384 rows. A row's result does not depend on the others: same bits.
static int64_t row_block_bytes = 524288;  // (0: every product in one pass; q4_row_block_bytes sets it, benchmarks)

int64_t q4_row_block_bytes(int64_t bytes) {  // sets the budget when bytes >= 0; returns the one in force
    if (bytes >= 0) row_block_bytes = bytes;
    return row_block_bytes;
}

int64_t q4_row_block(int64_t k) {
    if (row_block_bytes == 0) return INT64_MAX;
    const int64_t rows = (row_block_bytes / k) / 16 * 16;
    return rows < 64 ? 64 : rows;
}

// y [M, N] (row stride N) = x W^T; threads > 1: the row groups split over OpenMP threads (the runtime torch uses)
// in contiguous ranges; more than q4_row_block(k) rows in passes of that many.
void q4_gemm(const uint8_t *w, int64_t n, int64_t k, const int8_t *xq, const float *xs, const float *isum, int64_t m,
             float *y, int threads) {
    const int64_t groups = (n + 3) / 4, blk = q4_row_block(k);
    if (m > blk) {
        const int64_t astride = chunks_of(k) * 512, sstride = chunks_of(k) * 16;
        for (int64_t m0 = 0; m0 < m; m0 += blk)
            q4_gemm(w, n, k, xq + m0 * astride, xs + m0 * sstride, isum + m0 * sstride, m - m0 < blk ? m - m0 : blk,
                    y + m0 * n, threads);
        return;
    }
#ifdef __AMX_INT8__
    if (amx_min_rows > 0 && m >= amx_min_rows && q4_amx_ready() && q4_gemm_amx(w, n, k, xq, xs, isum, m, y, threads))
        return;
#endif
    if (threads <= 1 || groups < 64) {
        run_groups(w, n, k, xq, xs, isum, m, y, 0, groups);
        return;
    }
#pragma omp parallel num_threads(threads)
    {
        const int t = omp_get_thread_num(), nt = omp_get_num_threads();
        const int64_t per = (groups + nt - 1) / nt;
        const int64_t g0 = t * per, g1 = g0 + per < groups ? g0 + per : groups;
        if (g0 < g1) run_groups(w, n, k, xq, xs, isum, m, y, g0, g1);
    }
}

// ---- int8 weights (Q8Linear): w = q * scale per group of 32, q in -128..127, fp16 scale; 8.5 bits a weight ----
// Row groups of 4 rows as above; per chunk of ng <= 16 groups (ng_h = 8, or fewer in the last chunk's halves):
//   uint16 scale[4][16]                                   fp16 (zero past ng)
//   int8   codes[4 rows][halves h][8 pieces p][ng_h][4]    weights 4 p .. 4 p + 3 of group 8 h + l
// so that a code vector (its first ng_h lanes loaded, the rest zero) lines up with the activations' piece vector
// (q4_quant_act's layout, the same codes) and 32-bit lane l of a dot product is group l's. u8 x s8 pairs by the
// sign trick: maddubs(|q|, x * sign(q)) = q * x pairwise, at most 2 * 128 * 127 = 32512 (no int16 saturation); then
// madd with ones (AVX2) or one dpbusd
// (AVX-512 VNNI): the same int32 dot products either way, and the same float operations after (fixed order, the
// same bits from both builds). y[m, n] = sum_g scale[n, g] * xs[m, g] * dot_g(q, xq).
int64_t q8_group_bytes(int64_t k) { return chunks_of(k) * 128 + (k / 32) * 128; }

// the 32 code bytes of (row r, half h, piece pc) in a chunk of ng groups (cp: its codes), zero past ng_h groups
INLINE __m256i q8_codes(const uint8_t *cp, int ng, int r, int h, int pc) {
    const int ngh = ng - 8 * h < 8 ? ng - 8 * h : 8;
    const int *src = (const int *)(cp + r * 32 * ng + h * 256 + pc * 4 * ngh);
    if (ngh == 8) return _mm256_loadu_si256((const __m256i *)src);
    const __m256i lanes = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    return _mm256_maskload_epi32(src, _mm256_cmpgt_epi32(_mm256_set1_epi32(ngh), lanes));
}

INLINE __m256i dot_s8(__m256i acc, __m256i aw, __m256i w, __m256i x) {
    const __m256i sx = _mm256_sign_epi8(x, w);
#ifdef __AVX512VNNI__
    return _mm256_dpbusd_epi32(acc, aw, sx);
#else
    return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(aw, sx), _mm256_set1_epi16(1)));
#endif
}

// row r of a row group, half h of a chunk (its codes cp, ng groups, scales hdr), against mb activation rows (xc: the
// chunk's codes of row 0, xsc: its scales): acc[i] += the 8 groups' int32 dot products * scale * xs, lane by lane
INLINE void q8_half(const uint8_t *cp, const uint16_t *hdr, int ng, int r, int h, const int8_t *xc, int64_t astride,
                    const float *xsc, int64_t sstride, const int mb, __m256 *acc) {
    __m256i s32[8];
    for (int i = 0; i < mb; i++) s32[i] = _mm256_setzero_si256();
    for (int pc = 0; pc < 8; pc++) {
        const __m256i w = q8_codes(cp, ng, r, h, pc);
        const __m256i aw = _mm256_abs_epi8(w);
        for (int i = 0; i < mb; i++)
            s32[i] = dot_s8(s32[i], aw, w, _mm256_loadu_si256((const __m256i *)(xc + i * astride + 64 * pc + 32 * h)));
    }
    const __m256 sw = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(hdr + 16 * r + 8 * h)));
    for (int i = 0; i < mb; i++)
        acc[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s32[i]), _mm256_mul_ps(sw, _mm256_loadu_ps(xsc + i * sstride + 8 * h)),
                                 acc[i]);
}

// one row group (4 weight rows) x mb (<= 8) activation rows -> out[i * 4 + r]: row by row, all chunks
INLINE void q8_group_rows(const uint8_t *g, int64_t k, const int8_t *xq, const float *xs, const int mb, float *out) {
    const int64_t groups = k / 32, chunks = chunks_of(k), astride = chunks * 512, sstride = chunks * 16;
    for (int r = 0; r < 4; r++) {
        __m256 acc[8];
        for (int i = 0; i < mb; i++) acc[i] = _mm256_setzero_ps();
        const uint8_t *p = g;
        for (int64_t c = 0; c < chunks; c++) {
            const int ng = (int)(groups - 16 * c < 16 ? groups - 16 * c : 16);
            if (r == 0)  // (unlike group_rows' K blocks, a pass here runs the whole row group: pass 0 fetches it)
                for (int l = 0; l < 128 + 128 * ng; l += 64) _mm_prefetch((const char *)(p + PFD + l), _MM_HINT_T0);
            for (int h = 0; 8 * h < ng; h++)
                q8_half(p + 128, (const uint16_t *)p, ng, r, h, xq + c * 512, astride, xs + 16 * c, sstride, mb, acc);
            p += 128 + 128 * ng;
        }
        for (int i = 0; i < mb; i++) out[4 * i + r] = hsum8(acc[i]);
    }
}

// 1-2 activation rows: chunk by chunk with the 4 rows inside (the row group's bytes read in order), 4 x mb
// accumulators; per output the same operations in the same order as q8_group_rows
INLINE void q8_group_rows_few(const uint8_t *g, int64_t k, const int8_t *xq, const float *xs, const int mb,
                              float *out) {
    const int64_t groups = k / 32, chunks = chunks_of(k), astride = chunks * 512, sstride = chunks * 16;
    __m256 acc[4][2];
    for (int r = 0; r < 4; r++)
        for (int i = 0; i < mb; i++) acc[r][i] = _mm256_setzero_ps();
    const uint8_t *p = g;
    for (int64_t c = 0; c < chunks; c++) {
        const int ng = (int)(groups - 16 * c < 16 ? groups - 16 * c : 16);
        for (int l = 0; l < 128 + 128 * ng; l += 64) _mm_prefetch((const char *)(p + PFD + l), _MM_HINT_T0);
        for (int h = 0; 8 * h < ng; h++)
            for (int r = 0; r < 4; r++)
                q8_half(p + 128, (const uint16_t *)p, ng, r, h, xq + c * 512, astride, xs + 16 * c, sstride, mb, acc[r]);
        p += 128 + 128 * ng;
    }
    for (int r = 0; r < 4; r++)
        for (int i = 0; i < mb; i++) out[4 * i + r] = hsum8(acc[r][i]);
}

// 1-2 activation rows in a function of their own: inlined into q8_run_groups beside the 3-8-row paths, gcc laid them
// out so that 2 rows took longer than 3 (Zen 2); here 2 rows take 0.85-0.91x that time (docs/quantization.md,
// session 60). Same operations, same bits.
// pinned as run_groups is (above): at 16 bytes past a 64-byte boundary its 1-row and 2-row products measured
// 0.93-0.99x / 0.86-0.93x the time they took where the linker happened to put it, at 0 / 32 / 48 0.97-1.03x
// (session 63); Q8_ENTRY moves it
#ifndef Q8_ENTRY
#define Q8_ENTRY 16
#endif
__attribute__((hot, aligned(64), patchable_function_entry(Q8_ENTRY, Q8_ENTRY)))
__attribute__((noinline)) static void q8_run_groups_few(const uint8_t *w, int64_t n, int64_t k, const int8_t *xq,
                                                        const float *xs, int64_t m, float *y, int64_t g0, int64_t g1) {
    const int64_t gbytes = q8_group_bytes(k);
    float out[8];
    for (int64_t gi = g0; gi < g1; gi++) {
        if (m == 1) q8_group_rows_few(w + gi * gbytes, k, xq, xs, 1, out);
        else q8_group_rows_few(w + gi * gbytes, k, xq, xs, 2, out);
        for (int i = 0; i < m; i++)
            for (int r = 0; r < 4 && 4 * gi + r < n; r++) y[i * n + 4 * gi + r] = out[4 * i + r];
    }
}

static void q8_run_groups(const uint8_t *w, int64_t n, int64_t k, const int8_t *xq, const float *xs, int64_t m,
                          float *y, int64_t g0, int64_t g1) {
    const int64_t gbytes = q8_group_bytes(k), astride = chunks_of(k) * 512, sstride = chunks_of(k) * 16;
    if (m <= 2) {
        q8_run_groups_few(w, n, k, xq, xs, m, y, g0, g1);
        return;
    }
    float out[4 * 8];
    for (int64_t gi = g0; gi < g1; gi++) {
        const uint8_t *g = w + gi * gbytes;
        for (int64_t m0 = 0; m0 < m; m0 += 8) {
            const int mb = (int)(m - m0 < 8 ? m - m0 : 8);
            const int8_t *xb = xq + m0 * astride;
            const float *sb = xs + m0 * sstride;
            switch (mb) {  // constant row counts: the accumulators stay in registers
                case 1: q8_group_rows_few(g, k, xb, sb, 1, out); break;
                case 2: q8_group_rows_few(g, k, xb, sb, 2, out); break;
                case 3: q8_group_rows(g, k, xb, sb, 3, out); break;
                case 4: q8_group_rows(g, k, xb, sb, 4, out); break;
                case 5: q8_group_rows(g, k, xb, sb, 5, out); break;
                case 6: q8_group_rows(g, k, xb, sb, 6, out); break;
                case 7: q8_group_rows(g, k, xb, sb, 7, out); break;
                default: q8_group_rows(g, k, xb, sb, 8, out); break;
            }
            for (int i = 0; i < mb; i++)
                for (int r = 0; r < 4 && 4 * gi + r < n; r++) y[(m0 + i) * n + 4 * gi + r] = out[4 * i + r];
        }
    }
}

// y [M, N] = x W^T for the int8 layout (activations from q4_quant_act; its isum is not needed), threads as q4_gemm
void q8_gemm(const uint8_t *w, int64_t n, int64_t k, const int8_t *xq, const float *xs, int64_t m, float *y,
             int threads) {
    const int64_t groups = (n + 3) / 4;
    if (threads <= 1 || groups < 64) {
        q8_run_groups(w, n, k, xq, xs, m, y, 0, groups);
        return;
    }
#pragma omp parallel num_threads(threads)
    {
        const int t = omp_get_thread_num(), nt = omp_get_num_threads();
        const int64_t per = (groups + nt - 1) / nt;
        const int64_t g0 = t * per, g1 = g0 + per < groups ? g0 + per : groups;
        if (g0 < g1) q8_run_groups(w, n, k, xq, xs, m, y, g0, g1);
    }
}

// x [M, K] float32 -> xq [M, chunks * 512] int8 (kernel order), xs [M, chunks * 16], isum [M, chunks * 16] (see
// top). Same arithmetic as cpu_q4.quantize_activations: scale = max(amax, 1e-30) / 127, code =
// round-half-even(x / scale), isum = (float)(sum of codes) * scale.
#ifdef __AVX512VNNI__
void q4_quant_act(const float *x, int64_t m, int64_t k, int8_t *xq, float *xs, float *isum) {
    const int64_t groups = k / 32, chunks = chunks_of(k), sstride = chunks * 16, astride = chunks * 512;
    for (int64_t i = 0; i < m; i++) {
        const float *xr = x + i * k;
        int8_t *qr = xq + i * astride;
        float *sr = xs + i * sstride, *ir = isum + i * sstride;
        for (int64_t gi = groups; gi < sstride; gi++) {
            sr[gi] = ir[gi] = 0.0f;
            for (int p = 0; p < 8; p++) memset(qr + (gi / 16) * 512 + p * 64 + (gi % 16) * 4, 0, 4);
        }
        for (int64_t gi = 0; gi < groups; gi++) {
            const float *xg = xr + gi * 32;
            const __m512 a = _mm512_loadu_ps(xg), b = _mm512_loadu_ps(xg + 16);
            const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(a), _mm512_abs_ps(b)));
            const float s = (amax > 1e-30f ? amax : 1e-30f) / 127.0f;
            const __m512 sv = _mm512_set1_ps(s);
            const int rnd = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
            const __m512i qa = _mm512_cvtps_epi32(_mm512_roundscale_ps(_mm512_div_ps(a, sv), rnd));
            const __m512i qb = _mm512_cvtps_epi32(_mm512_roundscale_ps(_mm512_div_ps(b, sv), rnd));
            int32_t pieces[8];
            _mm_storeu_si128((__m128i *)pieces, _mm512_cvtepi32_epi8(qa));
            _mm_storeu_si128((__m128i *)(pieces + 4), _mm512_cvtepi32_epi8(qb));
            int8_t *dst = qr + (gi / 16) * 512 + (gi % 16) * 4;
            for (int p = 0; p < 8; p++) memcpy(dst + p * 64, pieces + p, 4);
            sr[gi] = s;
            ir[gi] = (float)_mm512_reduce_add_epi32(_mm512_add_epi32(qa, qb)) * s;
        }
    }
}
#else
void q4_quant_act(const float *x, int64_t m, int64_t k, int8_t *xq, float *xs, float *isum) {
    const int64_t groups = k / 32, chunks = chunks_of(k), sstride = chunks * 16, astride = chunks * 512;
    for (int64_t i = 0; i < m; i++) {
        const float *xr = x + i * k;
        int8_t *qr = xq + i * astride;
        float *sr = xs + i * sstride, *ir = isum + i * sstride;
        for (int64_t gi = groups; gi < sstride; gi++) {
            sr[gi] = ir[gi] = 0.0f;
            for (int p = 0; p < 8; p++) memset(qr + (gi / 16) * 512 + p * 64 + (gi % 16) * 4, 0, 4);
        }
        for (int64_t gi = 0; gi < groups; gi++) {
            const float *xg = xr + gi * 32;
            const __m256 sign = _mm256_set1_ps(-0.0f);
            __m256 v[4], mx = _mm256_setzero_ps();
            for (int e = 0; e < 4; e++) {
                v[e] = _mm256_loadu_ps(xg + 8 * e);
                mx = _mm256_max_ps(mx, _mm256_andnot_ps(sign, v[e]));
            }
            __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(mx), _mm256_extractf128_ps(mx, 1));
            m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
            const float amax = _mm_cvtss_f32(_mm_max_ss(m4, _mm_movehdup_ps(m4)));
            const float s = (amax > 1e-30f ? amax : 1e-30f) / 127.0f;
            const __m256 sv = _mm256_set1_ps(s);
            int32_t q[32];
            for (int e = 0; e < 4; e++)  // x / s rounded half to even, as torch.round
                _mm256_storeu_si256((__m256i *)(q + 8 * e), _mm256_cvtps_epi32(_mm256_round_ps(
                    _mm256_div_ps(v[e], sv), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)));
            int8_t *dst = qr + (gi / 16) * 512 + (gi % 16) * 4;
            int32_t sum = 0;
            for (int e = 0; e < 32; e++) {
                dst[(e / 4) * 64 + e % 4] = (int8_t)q[e];
                sum += q[e];
            }
            sr[gi] = s;
            ir[gi] = (float)sum * s;
        }
    }
}
#endif

// ---- GGUF Q6_K weights, exact (Q6KLinear: a Q4_K_M file's output head, 6.5625 bits a weight) ----
// w = d * scale_s * (q - 32), q in 0..63, per block of 256 weights = 8 groups of 32 (group g: sub-blocks 2 g, 2 g + 1
// of 16 weights, with int8 scales). Re-laid out at load (cpu_q4.pack_q6k; the same 210 bytes a block) so that the
// 32-bit lane g of a vector belongs to group g, as in the int8 layout: 4 bytes per group for piece p (weights
// 4 p .. 4 p + 3 of each group):
//   uint8 lo[4][8 groups][4]   low nibbles: piece k (low nibble) and piece k + 4 (high nibble)
//   uint8 hi[2][8 groups][4]   high 2 bits: pieces 4 m + s at bits 2 s, 2 s + 1
//   int8  scales[16]           as stored (sub-block order);  fp16 d
// Activations: the int4 product's (q4_quant_act: int8 codes per 32 values in its piece order, xs per group) and the
// sums of each 16 codes (bsum [M, groups * 2] int16). Per block and activation row, exactly in int32: lane g =
// sum_p scale(g, p < 4 ? a : b) * dot(q_p, x_p) - 32 * (scale_a * bsum_a + scale_b * bsum_b) (maddubs(q, x) pairs
// <= 2 * 63 * 127: no int16 saturation; two pieces' pairs, <= 32004, added in int16 before one madd by their scale:
// 4 madds a block and row instead of 8, the same integers, 0.82-0.91x the time at 2-8 rows on a Zen 2, session 63),
// then * d * xs[g] into 8 float lanes: the int8 kernel's structure, no reductions across lanes until the end. Each
// output's operations are the same whatever M and the thread split.
#define Q6K_BLOCK 210
// the 2 high bits of pieces 0-3 (h0) and 4-7 (h1) onto the low nibbles in q[8], W-bit vectors (256 or 512)
#define Q6K_HIGH_BITS(W, q, h0, h1, m30)                                                                         \
    do {                                                                                                          \
        for (int s_ = 0; s_ < 2; s_++) {                                                                         \
            const __m##W##i h_ = s_ ? (h1) : (h0);                                                                \
            q[4 * s_] = _mm##W##_or_si##W(q[4 * s_], _mm##W##_and_si##W(_mm##W##_slli_epi16(h_, 4), m30));         \
            q[4 * s_ + 1] = _mm##W##_or_si##W(q[4 * s_ + 1], _mm##W##_and_si##W(_mm##W##_slli_epi16(h_, 2), m30)); \
            q[4 * s_ + 2] = _mm##W##_or_si##W(q[4 * s_ + 2], _mm##W##_and_si##W(h_, m30));                      \
            q[4 * s_ + 3] = _mm##W##_or_si##W(q[4 * s_ + 3], _mm##W##_and_si##W(_mm##W##_srli_epi16(h_, 2), m30)); \
        }                                                                                                         \
    } while (0)
// pshufb masks: int16 scales of sub-blocks a (even) / b (odd) of each 32-bit lane's group, from the 16 scales
static const uint8_t Q6K_PICK[2][32] __attribute__((aligned(32))) = {
    {0, 1, 0, 1, 4, 5, 4, 5, 8, 9, 8, 9, 12, 13, 12, 13, 0, 1, 0, 1, 4, 5, 4, 5, 8, 9, 8, 9, 12, 13, 12, 13},
    {2, 3, 2, 3, 6, 7, 6, 7, 10, 11, 10, 11, 14, 15, 14, 15, 2, 3, 2, 3, 6, 7, 6, 7, 10, 11, 10, 11, 14, 15, 14, 15}};

// weight row w (nb blocks) x mb (<= 8) activation rows (xq in q4_quant_act's order, astride bytes a row; xs, bs
// per row sstride groups) -> out[0 .. mb)
INLINE void q6k_row(const uint8_t *w, int64_t nb, const int8_t *xq, int64_t astride, const float *xs,
                    const int16_t *bs, int64_t sstride, const int mb, float *out) {
    const __m256i m4 = _mm256_set1_epi8(0x0F), m30 = _mm256_set1_epi8(0x30);
    const __m256i pa = _mm256_load_si256((const __m256i *)Q6K_PICK[0]), pb = _mm256_load_si256((const __m256i *)Q6K_PICK[1]);
    __m256 facc[8];
    for (int i = 0; i < mb; i++) facc[i] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *blk = w + b * Q6K_BLOCK;
        _mm_prefetch((const char *)(blk + 1024), _MM_HINT_T0);
        _mm_prefetch((const char *)(blk + 1088), _MM_HINT_T0);
        _mm_prefetch((const char *)(blk + 1152), _MM_HINT_T0);
        _mm_prefetch((const char *)(blk + 1216), _MM_HINT_T0);
        const __m256i s16 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(blk + 192)));
        const __m256i sa = _mm256_shuffle_epi8(s16, pa), sbv = _mm256_shuffle_epi8(s16, pb);
        const __m256i h0 = _mm256_loadu_si256((const __m256i *)(blk + 128));
        const __m256i h1 = _mm256_loadu_si256((const __m256i *)(blk + 160));
        __m256i q[8];
        for (int kk = 0; kk < 4; kk++) {
            const __m256i lo = _mm256_loadu_si256((const __m256i *)(blk + 32 * kk));
            q[kk] = _mm256_and_si256(lo, m4);
            q[kk + 4] = _mm256_and_si256(_mm256_srli_epi16(lo, 4), m4);
        }
        Q6K_HIGH_BITS(256, q, h0, h1, m30);
        const __m256 d = _mm256_set1_ps(_cvtsh_ss(*(const uint16_t *)(blk + 208)));
        const int64_t xoff = (b / 2) * 512 + (b % 2) * 32;  // piece p of the block's 8 groups: + 64 p
        for (int i = 0; i < mb; i++) {
            const int8_t *xb = xq + i * astride + xoff;
            __m256i acc = _mm256_setzero_si256();
            for (int p = 0; p < 8; p += 2)  // two pieces' pair sums in int16 (<= 2 * 16002), then one madd by the scale
                acc = _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_add_epi16(
                    _mm256_maddubs_epi16(q[p], _mm256_loadu_si256((const __m256i *)(xb + 64 * p))),
                    _mm256_maddubs_epi16(q[p + 1], _mm256_loadu_si256((const __m256i *)(xb + 64 * p + 64)))),
                    p < 4 ? sa : sbv));
            const __m256i off = _mm256_madd_epi16(s16, _mm256_loadu_si256((const __m256i *)(bs + i * sstride * 2 + 16 * b)));
            acc = _mm256_sub_epi32(acc, _mm256_slli_epi32(off, 5));
            facc[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(acc), _mm256_mul_ps(d, _mm256_loadu_ps(xs + i * sstride + 8 * b)),
                                      facc[i]);
        }
    }
    for (int i = 0; i < mb; i++) out[i] = hsum8(facc[i]);
}

#ifdef __AVX512VNNI__
// q6k_row with 512-bit vectors (session 46): blocks b, b + 1 (b even) in the low / high halves of each vector (the
// activations of such a pair sit in one 64-byte piece: xoff below), so int32 lane g < 8 is group g of block b and
// lane 8 + g group g of block b + 1; the same integers per (block, group) as q6k_row, the float lanes then add up
// the even blocks (0-7) and the odd ones (8-15), an odd last block in 8 lanes of its own, a fixed reduction at
// the end. Per activation row and sub-block one VNNI dot product and one int32 multiply by its scale instead of
// maddubs + madd pairs of 256 bits (what verify rows pay); a row's result still does not depend on the others or
// the thread split.
INLINE float hsum16(__m512 a) {  // fixed order
    const __m256 h = _mm256_add_ps(_mm512_castps512_ps256(a), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(a), 1)));
    return hsum8(h);
}

INLINE __m512i pair512(const uint8_t *a, const uint8_t *b) {
    return _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)a)),
                              _mm256_loadu_si256((const __m256i *)b), 1);
}

INLINE void q6k_row512(const uint8_t *w, int64_t nb, const int8_t *xq, int64_t astride, const float *xs,
                       const int16_t *bs, int64_t sstride, const int mb, float *out) {
    const __m512i m4 = _mm512_set1_epi8(0x0F), m30 = _mm512_set1_epi8(0x30);
    __m512 facc[8];
    for (int i = 0; i < mb; i++) facc[i] = _mm512_setzero_ps();
    int64_t b = 0;
    for (; b + 2 <= nb; b += 2) {
        const uint8_t *b0 = w + b * Q6K_BLOCK, *b1 = b0 + Q6K_BLOCK;
        for (int l = 0; l < 7; l++) _mm_prefetch((const char *)(b0 + 1024 + 64 * l), _MM_HINT_T0);
        const __m256i sc8 = _mm256_set_m128i(_mm_loadu_si128((const __m128i *)(b1 + 192)),
                                             _mm_loadu_si128((const __m128i *)(b0 + 192)));
        const __m512i s16 = _mm512_cvtepi8_epi16(sc8);  // [block b: 16 scales | block b + 1: 16 scales]
        // int32 lane g: the scales of its two sub-blocks (the same integers as q6k_row's pair sums: a sub-block's
        // dot product <= 16 * 63 * 127, times a scale, in int32)
        const __m512i sa = _mm512_srai_epi32(_mm512_slli_epi32(s16, 16), 16), sbv = _mm512_srai_epi32(s16, 16);
        const __m512i h0 = pair512(b0 + 128, b1 + 128), h1 = pair512(b0 + 160, b1 + 160);
        __m512i q[8];
        for (int kk = 0; kk < 4; kk++) {
            const __m512i lo = pair512(b0 + 32 * kk, b1 + 32 * kk);
            q[kk] = _mm512_and_si512(lo, m4);
            q[kk + 4] = _mm512_and_si512(_mm512_srli_epi16(lo, 4), m4);
        }
        Q6K_HIGH_BITS(512, q, h0, h1, m30);
        const __m512 d = _mm512_castpd_ps(_mm512_insertf64x4(
            _mm512_castps_pd(_mm512_set1_ps(_cvtsh_ss(*(const uint16_t *)(b0 + 208)))),
            _mm256_castps_pd(_mm256_set1_ps(_cvtsh_ss(*(const uint16_t *)(b1 + 208)))), 1));
        const int64_t xoff = (b / 2) * 512;  // piece p of both blocks' 8 groups: + 64 p (block b + 1: + 32)
        for (int i = 0; i < mb; i++) {
            const int8_t *xb = xq + i * astride + xoff;
            __m512i da = _mm512_setzero_si512(), db = _mm512_setzero_si512();  // lane g: sub-block 2 g / 2 g + 1
            for (int p = 0; p < 4; p++) {
                da = _mm512_dpbusd_epi32(da, q[p], _mm512_loadu_si512((const void *)(xb + 64 * p)));
                db = _mm512_dpbusd_epi32(db, q[p + 4], _mm512_loadu_si512((const void *)(xb + 64 * (p + 4))));
            }
            __m512i acc = _mm512_add_epi32(_mm512_mullo_epi32(da, sa), _mm512_mullo_epi32(db, sbv));
            const __m512i off = _mm512_madd_epi16(s16, _mm512_loadu_si512((const void *)(bs + i * sstride * 2 + 16 * b)));
            acc = _mm512_sub_epi32(acc, _mm512_slli_epi32(off, 5));
            facc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc), _mm512_mul_ps(d, _mm512_loadu_ps(xs + i * sstride + 8 * b)),
                                      facc[i]);
        }
    }
    if (b < nb) {  // an odd last block: q6k_row's 8 lanes
        float tail[8];
        q6k_row(w + b * Q6K_BLOCK, 1, xq + (b / 2) * 512, astride, xs + 8 * b, bs + 16 * b, sstride, mb, tail);
        for (int i = 0; i < mb; i++) out[i] = hsum16(facc[i]) + tail[i];
        return;
    }
    for (int i = 0; i < mb; i++) out[i] = hsum16(facc[i]);
}
#define Q6K_ROW q6k_row512
#else
#define Q6K_ROW q6k_row
#endif

static void q6k_run_rows(const uint8_t *w, int64_t n0, int64_t n1, int64_t n, int64_t k, const int8_t *xq,
                         const float *xs, const int16_t *bs, int64_t m, float *y) {
    const int64_t nb = k / 256, rb = nb * Q6K_BLOCK, astride = chunks_of(k) * 512, sstride = chunks_of(k) * 16;
    float out[8];
    for (int64_t r = n0; r < n1; r++) {
        for (int64_t m0 = 0; m0 < m; m0 += 8) {
            const int mb = (int)(m - m0 < 8 ? m - m0 : 8);
            const int8_t *xb = xq + m0 * astride;
            const float *sb = xs + m0 * sstride;
            const int16_t *bb = bs + m0 * sstride * 2;
            switch (mb) {  // constant row counts: the accumulators stay in registers
                case 1: Q6K_ROW(w + r * rb, nb, xb, astride, sb, bb, sstride, 1, out); break;
                case 2: Q6K_ROW(w + r * rb, nb, xb, astride, sb, bb, sstride, 2, out); break;
                case 3: Q6K_ROW(w + r * rb, nb, xb, astride, sb, bb, sstride, 3, out); break;
                case 4: Q6K_ROW(w + r * rb, nb, xb, astride, sb, bb, sstride, 4, out); break;
                case 5: Q6K_ROW(w + r * rb, nb, xb, astride, sb, bb, sstride, 5, out); break;
                case 6: Q6K_ROW(w + r * rb, nb, xb, astride, sb, bb, sstride, 6, out); break;
                case 7: Q6K_ROW(w + r * rb, nb, xb, astride, sb, bb, sstride, 7, out); break;
                default: Q6K_ROW(w + r * rb, nb, xb, astride, sb, bb, sstride, 8, out); break;
            }
            for (int i = 0; i < mb; i++) y[(m0 + i) * n + r] = out[i];
        }
    }
}

// y [M, N] = x W^T, W [N, K] in the layout above (K % 256 == 0), activations from q4_quant_act (+ bsum); rows split
// over threads
void q6k_gemm(const uint8_t *w, int64_t n, int64_t k, const int8_t *xq, const float *xs, const int16_t *bs,
              int64_t m, float *y, int threads) {
    if (threads <= 1 || n < 256) {
        q6k_run_rows(w, 0, n, n, k, xq, xs, bs, m, y);
        return;
    }
#pragma omp parallel num_threads(threads)
    {
        const int t = omp_get_thread_num(), nt = omp_get_num_threads();
        const int64_t per = (n + nt - 1) / nt;
        const int64_t n0 = t * per, n1 = n0 + per < n ? n0 + per : n;
        if (n0 < n1) q6k_run_rows(w, n0, n1, n, k, xq, xs, bs, m, y);
    }
}
