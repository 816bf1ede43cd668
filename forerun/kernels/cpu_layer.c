/* CPU layer kernels besides the matrix products (float32): paged attention one query row at a time, add +
 * RMSNorm, and Q/K norm + RoPE + the cache write. Built and loaded by cpu_layer.py (gcc -O3, AVX-512 or AVX2).
 *
 * Why: at batch 1 an int4 decode step of the 1.5B model spent ~30 % of its time outside the matrix products, in
 * ~15 small torch ops per layer (each a dispatch and, with 2 threads, a thread-pool wake-up). These loops do the
 * same arithmetic in one call per operation.
 *
 * Batch invariance (what keeps greedy speculative output equal to plain output, bit for bit): every output row
 * is computed by one thread, alone, in a fixed order that depends only on that row (its own query, its own
 * visible keys, its own hidden vector), never on how many rows the call holds or how they are split over threads.
 */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

static inline float dot(const float *a, const float *b, int64_t d) {
#ifdef __AVX512F__
    if ((d & 15) == 0) {
        __m512 acc = _mm512_setzero_ps();
        for (int64_t e = 0; e < d; e += 16)
            acc = _mm512_fmadd_ps(_mm512_loadu_ps(a + e), _mm512_loadu_ps(b + e), acc);
        return _mm512_reduce_add_ps(acc);
    }
#else /* AVX2 build: two 8-lane accumulators (the same 16 partial sums), reduced in a fixed order */
    if ((d & 15) == 0) {
        __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps();
        for (int64_t e = 0; e < d; e += 16) {
            a0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + e), _mm256_loadu_ps(b + e), a0);
            a1 = _mm256_fmadd_ps(_mm256_loadu_ps(a + e + 8), _mm256_loadu_ps(b + e + 8), a1);
        }
        const __m256 s8 = _mm256_add_ps(a0, a1);
        __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(s8), _mm256_extractf128_ps(s8, 1));
        s4 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
        return _mm_cvtss_f32(_mm_add_ss(s4, _mm_movehdup_ps(s4)));
    }
#endif
    float s = 0.f;
    for (int64_t e = 0; e < d; e++)
        s += a[e] * b[e];
    return s;
}

#ifdef __AVX512F__
/* ---- AVX-512: one work item with its scores 16 keys at a time, a vector exp, values in registers (session 43) ----
 * The scalar loop below spent most of a long prompt's prefill in expf and in one horizontal sum per key and head
 * (Qwen2.5-1.5B, 2,048 tokens: ~17 s of a 28 s forward on 2 threads). Same arithmetic, reordered for vectors: every
 * score is still a fixed-order sum over its own query and key, the softmax runs over the row's own keys in key order,
 * so a row's bits still depend on that row alone (batch invariance). */

/* lane j of the result = the sum of a[j]'s 16 lanes, in a fixed tree */
static inline __m512 hsum16(const __m512 *a) {
    __m512 s[8], u[4];
    for (int i = 0; i < 8; i++)
        s[i] = _mm512_add_ps(_mm512_unpacklo_ps(a[2 * i], a[2 * i + 1]), _mm512_unpackhi_ps(a[2 * i], a[2 * i + 1]));
    for (int i = 0; i < 4; i++) {  /* 128-bit lane q of u[i]: keys 4 i .. 4 i + 3, partial sums of that lane */
        const __m512d lo = _mm512_unpacklo_pd(_mm512_castps_pd(s[2 * i]), _mm512_castps_pd(s[2 * i + 1]));
        const __m512d hi = _mm512_unpackhi_pd(_mm512_castps_pd(s[2 * i]), _mm512_castps_pd(s[2 * i + 1]));
        u[i] = _mm512_add_ps(_mm512_castpd_ps(lo), _mm512_castpd_ps(hi));
    }
    const __m512 x0 = _mm512_add_ps(_mm512_shuffle_f32x4(u[0], u[1], 0x44), _mm512_shuffle_f32x4(u[0], u[1], 0xEE));
    const __m512 x1 = _mm512_add_ps(_mm512_shuffle_f32x4(u[2], u[3], 0x44), _mm512_shuffle_f32x4(u[2], u[3], 0xEE));
    return _mm512_add_ps(_mm512_shuffle_f32x4(x0, x1, 0x88), _mm512_shuffle_f32x4(x0, x1, 0xDD));
}

/* e^x for x <= 0 (scores minus their maximum), Cephes' expf: x = n ln2 + r, |r| <= ln2 / 2, a degree-7 polynomial,
 * then 2^n; within ~2 ulp of expf (tests: the attention against torch's rows); -inf and anything below ~-103 give 0 */
static inline __m512 exp512(__m512 x) {
    x = _mm512_max_ps(x, _mm512_set1_ps(-104.0f));
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
    __m512 p = _mm512_set1_ps(1.9875691500e-4f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
    p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
    return _mm512_scalef_ps(p, n);
}

/* One work item: rows r0 .. r0 + nr - 1 (nr <= ATTN_RB, consecutive rows whose keys start at the same place:
 * the same sequence's key list) x kv head h, D = 16 * DV. A row sees its own first len[r] keys, taken 16 at a time;
 * the rows of the item share each tile of 16 keys (and of 16 values) while it is in L1: one row at a time streamed
 * every key and value of a long prompt from L3 for each row (2,048 rows: 2 x 1 MB per row and kv head). Per row and
 * query head the operations and their order depend on that row alone (its query, its len[r] keys, tile by tile),
 * so a row gives the same bits alone or in any item. sc [ATTN_RB][g][maxlen] scores, ob [ATTN_RB][g][D]. */
#define ATTN_RB 16
#define ATTN_ITEM(DV)                                                                                               \
static void attn_item_##DV(const float *q, const float *kc, const float *vc, const int64_t *ks, const int64_t *len,  \
                           int64_t r0, int64_t nr, int64_t hq, int64_t g, int64_t h, int64_t hkv, int64_t maxlen,    \
                           float *sc, float *ob, float *out) {                                                      \
    const int64_t d = 16 * DV;                                                                                      \
    int64_t longest = 0;                                                                                            \
    for (int64_t r = 0; r < nr; r++) longest = len[r0 + r] > longest ? len[r0 + r] : longest;                       \
    for (int64_t j0 = 0; j0 < longest; j0 += 16) {  /* scores, tile by tile */                                      \
        for (int64_t r = 0; r < nr; r++) {                                                                          \
            const int64_t n = len[r0 + r];                                                                          \
            if (j0 >= n) continue;                                                                                  \
            const int64_t nb = n - j0 < 16 ? n - j0 : 16;                                                           \
            for (int64_t i = 0; i < g; i++) {                                                                       \
                const float *qi = q + ((r0 + r) * hq + h * g + i) * d;                                              \
                __m512 qv[DV], acc[16];                                                                             \
                for (int c = 0; c < DV; c++) qv[c] = _mm512_loadu_ps(qi + 16 * c);                                  \
                for (int jj = 0; jj < 16; jj++) {                                                                   \
                    acc[jj] = _mm512_setzero_ps();                                                                  \
                    if (jj < nb) {                                                                                  \
                        const float *kj = kc + (ks[j0 + jj] * hkv + h) * d;                                         \
                        for (int c = 0; c < DV; c++) acc[jj] = _mm512_fmadd_ps(qv[c], _mm512_loadu_ps(kj + 16 * c), acc[jj]); \
                    }                                                                                               \
                }                                                                                                   \
                _mm512_mask_storeu_ps(sc + (r * g + i) * maxlen + j0, (__mmask16)((1u << nb) - 1), hsum16(acc));    \
            }                                                                                                       \
        }                                                                                                           \
    }                                                                                                               \
    float inv[ATTN_RB * 16];                                                                                        \
    for (int64_t r = 0; r < nr; r++) {  /* softmax of each row and head over its own keys, in key order */          \
        const int64_t n = len[r0 + r];                                                                              \
        for (int64_t i = 0; i < g; i++) {                                                                           \
            float *si = sc + (r * g + i) * maxlen;                                                                  \
            __m512 mx = _mm512_set1_ps(-INFINITY), sum = _mm512_setzero_ps();                                       \
            for (int64_t j0 = 0; j0 < n; j0 += 16) {                                                                \
                const __mmask16 mk = (__mmask16)(n - j0 < 16 ? (1u << (n - j0)) - 1 : 0xFFFF);                       \
                mx = _mm512_max_ps(mx, _mm512_mask_loadu_ps(_mm512_set1_ps(-INFINITY), mk, si + j0));                \
            }                                                                                                       \
            const __m512 m = _mm512_set1_ps(_mm512_reduce_max_ps(mx));                                              \
            for (int64_t j0 = 0; j0 < n; j0 += 16) {                                                                \
                const __mmask16 mk = (__mmask16)(n - j0 < 16 ? (1u << (n - j0)) - 1 : 0xFFFF);                       \
                const __m512 e = _mm512_maskz_mov_ps(mk, exp512(_mm512_sub_ps(_mm512_maskz_loadu_ps(mk, si + j0), m))); \
                _mm512_mask_storeu_ps(si + j0, mk, e);                                                              \
                sum = _mm512_add_ps(sum, e);                                                                        \
            }                                                                                                       \
            inv[r * g + i] = 1.f / _mm512_reduce_add_ps(sum);                                                       \
        }                                                                                                           \
    }                                                                                                               \
    memset(ob, 0, sizeof(float) * (size_t)(nr * g * d));                                                            \
    for (int64_t j0 = 0; j0 < longest; j0 += 16) {  /* weighted values, tile by tile, each row's in key order */    \
        for (int64_t r = 0; r < nr; r++) {                                                                          \
            const int64_t n = len[r0 + r];                                                                          \
            if (j0 >= n) continue;                                                                                  \
            const int64_t j1 = n - j0 < 16 ? n : j0 + 16;                                                           \
            for (int64_t i = 0; i < g; i++) {                                                                       \
                const float *si = sc + (r * g + i) * maxlen;                                                        \
                float *oi = ob + (r * g + i) * d;                                                                   \
                __m512 o[DV];                                                                                       \
                for (int c = 0; c < DV; c++) o[c] = _mm512_loadu_ps(oi + 16 * c);                                   \
                for (int64_t j = j0; j < j1; j++) {                                                                 \
                    const __m512 p = _mm512_set1_ps(si[j]);                                                         \
                    const float *vj = vc + (ks[j] * hkv + h) * d;                                                   \
                    for (int c = 0; c < DV; c++) o[c] = _mm512_fmadd_ps(p, _mm512_loadu_ps(vj + 16 * c), o[c]);    \
                }                                                                                                   \
                for (int c = 0; c < DV; c++) _mm512_storeu_ps(oi + 16 * c, o[c]);                                   \
            }                                                                                                       \
        }                                                                                                           \
    }                                                                                                               \
    for (int64_t r = 0; r < nr; r++)                                                                                \
        for (int64_t i = 0; i < g; i++) {                                                                           \
            const __m512 iv = _mm512_set1_ps(inv[r * g + i]);                                                       \
            const float *oi = ob + (r * g + i) * d;                                                                 \
            float *dst = out + ((r0 + r) * hq + h * g + i) * d;                                                     \
            for (int c = 0; c < DV; c++) _mm512_storeu_ps(dst + 16 * c, _mm512_mul_ps(_mm512_loadu_ps(oi + 16 * c), iv)); \
        }                                                                                                           \
}
ATTN_ITEM(4)  /* D = 64 (SmolLM2, Qwen2.5-0.5B) */
ATTN_ITEM(8)  /* D = 128 (Qwen2.5-1.5B, Llama, Qwen3) */
#endif

/* q [T, Hq, D] (pre-scaled by the softmax scale); kc, vc [S, Hkv, D] (S cache slots); row r sees the keys at the
 * slots keys[off[r] .. off[r] + len[r]) in that order; out [T, Hq, D]. Work item (row, kv head): its g = Hq / Hkv
 * query heads against the kv head's keys: scores, softmax (max, exp, sum in key order), weighted sum of values. */
static int attn_blocked = 1;  /* 0: every row on the scalar loop below (benchmarks/prefill_cpu.py compares) */
int attn_rows_blocked(int on) {  /* sets it when on >= 0; returns the setting in force */
    if (on >= 0) attn_blocked = on;
    return attn_blocked;
}

void attn_rows(const float *q, const float *kc, const float *vc, const int64_t *keys, const int64_t *off,
               const int64_t *len, float *out, int64_t t, int64_t hq, int64_t hkv, int64_t d, int64_t maxlen) {
    const int64_t g = hq / hkv;
#ifdef __AVX512F__
    if (attn_blocked && (d == 64 || d == 128) && g <= 16 && maxlen > 0) {
        /* items of up to ATTN_RB consecutive rows whose keys start at the same place (a row with no key alone) */
        int64_t *start = (int64_t *)malloc(sizeof(int64_t) * (size_t)(t + 1)), items = 0;
        for (int64_t r = 0; r < t; r++)
            if (r == 0 || off[r] != off[r - 1] || r - start[items - 1] >= ATTN_RB || len[r] == 0 || len[r - 1] == 0)
                start[items++] = r;
        start[items] = t;
#pragma omp parallel
        {
            float *sc = (float *)malloc(sizeof(float) * (size_t)(ATTN_RB * g * maxlen + 16));
            float *ob = (float *)malloc(sizeof(float) * (size_t)(ATTN_RB * g * d));
#pragma omp for schedule(dynamic, 1)
            for (int64_t w = 0; w < items * hkv; w++) {
                const int64_t it = w / hkv, h = w % hkv, r0 = start[it], nr = start[it + 1] - r0;
                if (len[r0] == 0) {  /* a row with no visible key: zeros, as below */
                    for (int64_t i = 0; i < g; i++) memset(out + (r0 * hq + h * g + i) * d, 0, sizeof(float) * (size_t)d);
                    continue;
                }
                (d == 64 ? attn_item_4 : attn_item_8)(q, kc, vc, keys + off[r0], len, r0, nr, hq, g, h, hkv, maxlen,
                                                       sc, ob, out);
            }
            free(sc);
            free(ob);
        }
        free(start);
        return;
    }
#endif
#pragma omp parallel
    {
        float *sc = (float *)malloc(sizeof(float) * (size_t)(g * (maxlen > 0 ? maxlen : 1) + 16));
#pragma omp for schedule(static)
        for (int64_t w = 0; w < t * hkv; w++) {
            const int64_t r = w / hkv, h = w % hkv, n = len[r];
            const int64_t *ks = keys + off[r];
            const float *qr = q + (r * hq + h * g) * d;
            float *orow = out + (r * hq + h * g) * d;
            for (int64_t j = 0; j < n; j++) {
                const float *kj = kc + (ks[j] * hkv + h) * d;
                for (int64_t i = 0; i < g; i++)
                    sc[i * maxlen + j] = dot(qr + i * d, kj, d);
            }
            for (int64_t i = 0; i < g; i++) {
                float *si = sc + i * maxlen, *oi = orow + i * d;
                float m = -INFINITY, sum = 0.f;
                for (int64_t j = 0; j < n; j++)
                    m = si[j] > m ? si[j] : m;
                for (int64_t j = 0; j < n; j++) {
                    si[j] = expf(si[j] - m);
                    sum += si[j];
                }
                const float inv = 1.f / sum;
                memset(oi, 0, sizeof(float) * (size_t)d);
                for (int64_t j = 0; j < n; j++) {
                    const float p = si[j] * inv;
                    const float *vj = vc + (ks[j] * hkv + h) * d;
                    for (int64_t e = 0; e < d; e++)
                        oi[e] += p * vj[e];
                }
            }
        }
        free(sc);
    }
}

static inline void rms_row(const float *x, const float *w, float eps, int64_t d, float *y) {
    const float ss = dot(x, x, d);
    const float r = 1.f / sqrtf(ss / (float)d + eps);
    for (int64_t e = 0; e < d; e++)
        y[e] = w[e] * (x[e] * r);
}

/* s = x + residual (residual NULL: s = x), written to s_out; y = w * s / sqrt(mean(s^2) + eps). [T, H] rows. */
void add_rmsnorm(const float *x, const float *res, const float *w, float eps, float *s_out, float *y, int64_t t,
                 int64_t h) {
#pragma omp parallel for schedule(static) if (t > 1)
    for (int64_t r = 0; r < t; r++) {
        const float *xr = x + r * h;
        float *sr = s_out + r * h;
        if (res != NULL) {
            const float *rr = res + r * h;
            for (int64_t e = 0; e < h; e++)
                sr[e] = xr[e] + rr[e];
        } else if (sr != xr) {
            memcpy(sr, xr, sizeof(float) * (size_t)h);
        }
        rms_row(sr, w, eps, h, y + r * h);
    }
}

/* qkv [T, (Hq + 2 Hkv) D] -> q_out [T, Hq, D] after the optional per-head Q/K RMSNorm (qw, kw NULL: none) and
 * rotate-half RoPE at positions[t] (cos, sin [P, D]); k and v written to the cache slots[t] of kc, vc
 * [S, Hkv, D]. */
void qkv_rope_store(const float *qkv, const int64_t *pos, const float *cos_t, const float *sin_t, const float *qw,
                    const float *kw, float eps, const int64_t *slots, float *kc, float *vc, float *q_out, int64_t t,
                    int64_t hq, int64_t hkv, int64_t d) {
    const int64_t width = (hq + 2 * hkv) * d, half = d / 2;
#pragma omp parallel for schedule(static) if (t > 1)
    for (int64_t r = 0; r < t; r++) {
        const float *row = qkv + r * width;
        const float *c = cos_t + pos[r] * d, *s = sin_t + pos[r] * d;
        float buf[1024];
        for (int64_t hh = 0; hh < hq + hkv; hh++) {
            const int is_q = hh < hq;
            const float *x = row + hh * d;
            float *dst = is_q ? q_out + (r * hq + hh) * d : kc + (slots[r] * hkv + (hh - hq)) * d;
            const float *nw = is_q ? qw : kw;
            if (nw != NULL) {
                rms_row(x, nw, eps, d, buf);
                x = buf;
            }
            for (int64_t e = 0; e < half; e++) {
                const float a = x[e], b = x[e + half];
                dst[e] = a * c[e] - b * s[e];
                dst[e + half] = b * c[e + half] + a * s[e + half];
            }
        }
        memcpy(vc + slots[r] * hkv * d, row + (hq + hkv) * d, sizeof(float) * (size_t)(hkv * d));
    }
}

/* exp of 8 floats (Cephes' expf: x = n ln2 + r, |r| <= ln2 / 2, a degree-6 polynomial, 2^n from the exponent
 * bits; ~1 ulp); x is clamped to [-87.3, 88.7] so that 2^n stays a normal float, and above 88.7 gives +inf. */
static inline __m256 exp8(__m256 x0) {
    const __m256 x = _mm256_min_ps(_mm256_max_ps(x0, _mm256_set1_ps(-87.3f)), _mm256_set1_ps(88.7f));
    const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
    __m256 p = _mm256_set1_ps(1.9875691500e-4f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
    p = _mm256_fmadd_ps(_mm256_mul_ps(p, r), r, _mm256_add_ps(r, _mm256_set1_ps(1.f)));
    const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_blendv_ps(_mm256_mul_ps(p, _mm256_castsi256_ps(e)), _mm256_set1_ps(INFINITY),
                            _mm256_cmp_ps(x0, _mm256_set1_ps(88.7f), _CMP_GT_OQ));
}

/* gu [T, 2 I] (gate, then up) -> out [T, I] = silu(gate) * up = gate / (1 + exp(-gate)) * up. Every value goes
 * through the same 8-lane code (a row's tail through a zero-padded vector), so it depends on its inputs alone. */
static void silu_mul_row(const float *g, const float *u, float *o, int64_t inter) {
    const __m256 one = _mm256_set1_ps(1.f);
    int64_t e = 0;
    for (; e + 8 <= inter; e += 8) {
        const __m256 x = _mm256_loadu_ps(g + e);
        const __m256 s = _mm256_div_ps(x, _mm256_add_ps(one, exp8(_mm256_sub_ps(_mm256_setzero_ps(), x))));
        _mm256_storeu_ps(o + e, _mm256_mul_ps(s, _mm256_loadu_ps(u + e)));
    }
    if (e < inter) {
        float gb[8] = {0}, ub[8] = {0}, ob[8];
        memcpy(gb, g + e, sizeof(float) * (size_t)(inter - e));
        memcpy(ub, u + e, sizeof(float) * (size_t)(inter - e));
        const __m256 x = _mm256_loadu_ps(gb);
        const __m256 s = _mm256_div_ps(x, _mm256_add_ps(one, exp8(_mm256_sub_ps(_mm256_setzero_ps(), x))));
        _mm256_storeu_ps(ob, _mm256_mul_ps(s, _mm256_loadu_ps(ub)));
        memcpy(o + e, ob, sizeof(float) * (size_t)(inter - e));
    }
}

void silu_mul(const float *gu, float *out, int64_t t, int64_t inter) {
#pragma omp parallel for schedule(static) if (t > 1)
    for (int64_t r = 0; r < t; r++)
        silu_mul_row(gu + r * 2 * inter, gu + r * 2 * inter + inter, out + r * inter, inter);
}

/* ---- a stack of decoder layers in one call (cpu_ops.CpuLayerOps.decoder_layers) ----
 * The int4 / int8 products are cpu_q4.c's, reached through the function pointers the caller passes (the two libraries
 * are built apart, with their own flags). Per layer, the same calls in the same order as the Python flat path
 * (and so the module path): add + RMSNorm, qkv product (+ bias), Q/K norm + RoPE + cache write, q * scale, row
 * attention, o product, add + RMSNorm, gate/up product, silu * up, down product. */
typedef void (*q4_quant_fn)(const float *, int64_t, int64_t, int8_t *, float *, float *);
typedef void (*q4_gemm_fn)(const uint8_t *, int64_t, int64_t, const int8_t *, const float *, const float *, int64_t,
                           float *, int);
typedef void (*q8_gemm_fn)(const uint8_t *, int64_t, int64_t, const int8_t *, const float *, int64_t, float *, int);

/* L_INT8: bit b set = product b (qkv, o, gate_up, down) is int8 (Q8Linear: q8_gemm), else int4 (q4_gemm) */
enum { L_LN1, L_QKV, L_QKV_B, L_QN, L_KN, L_O, L_O_B, L_LN2, L_GU, L_GU_B, L_DOWN, L_DOWN_B, L_KC, L_VC, L_INT8,
       L_FIELDS };

typedef struct {
    q4_quant_fn quant;
    q4_gemm_fn gemm;
    q8_gemm_fn gemm8;
    int threads;
    int8_t *xq;
    float *xs, *isum;
} linear_ctx;

/* y [m, n] = x [m, k] W^T (+ bias): q4_matmul's / q8_matmul's steps (quantize the rows, the product, then the
 * bias added) */
static void q4_linear(const linear_ctx *c, int64_t w, int64_t bias, int int8, const float *x, int64_t m, int64_t k,
                      int64_t n, float *y) {
    c->quant(x, m, k, c->xq, c->xs, c->isum);
    if (int8)
        c->gemm8((const uint8_t *)(intptr_t)w, n, k, c->xq, c->xs, m, y, c->threads);
    else
        c->gemm((const uint8_t *)(intptr_t)w, n, k, c->xq, c->xs, c->isum, m, y, c->threads);
    if (bias) {
        const float *b = (const float *)(intptr_t)bias;
        for (int64_t r = 0; r < m; r++)
            for (int64_t j = 0; j < n; j++)
                y[r * n + j] += b[j];
    }
}

/* tab [nl, L_FIELDS] (addresses; 0 = none), eps [nl, 3] (input norm, post-attention norm, Q/K norm).
 * h [T, H]: the input, replaced by the last layer's output; res [T, H]: the residual stream (read when has_res,
 * written always). Scratch: x [T, max(H, Hq D)], qkv [T, (Hq + 2 Hkv) D], q and att [T, Hq D], gu [T, 2 I],
 * act [T, I], and the activation codes of cpu_q4's q4_quant_act for T rows of the widest input (xq, xs, isum). */
void decoder_stack(const int64_t *tab, const float *eps, int64_t nl, float *h, float *res, int has_res, int64_t t,
                   int64_t hid, int64_t hq, int64_t hkv, int64_t d, int64_t inter, const int64_t *pos,
                   const float *cos_t, const float *sin_t, const int64_t *slots, const int64_t *keys,
                   const int64_t *off, const int64_t *len, int64_t maxlen, float scale, void *quant, void *gemm,
                   void *gemm8, int threads, float *x, float *qkv, float *q, float *att, float *gu, float *act,
                   int8_t *xq, float *xs, float *isum) {
    const linear_ctx c = {(q4_quant_fn)quant, (q4_gemm_fn)gemm, (q8_gemm_fn)gemm8, threads, xq, xs, isum};
    const int64_t width = (hq + 2 * hkv) * d, qd = hq * d;
    for (int64_t i = 0; i < nl; i++) {
        const int64_t *L = tab + i * L_FIELDS;
        const float *e = eps + i * 3;
        add_rmsnorm(h, (i == 0 && !has_res) ? NULL : res, (const float *)(intptr_t)L[L_LN1], e[0], res, x, t, hid);
        q4_linear(&c, L[L_QKV], L[L_QKV_B], L[L_INT8] & 1, x, t, hid, width, qkv);
        float *kc = (float *)(intptr_t)L[L_KC], *vc = (float *)(intptr_t)L[L_VC];
        qkv_rope_store(qkv, pos, cos_t, sin_t, (const float *)(intptr_t)L[L_QN], (const float *)(intptr_t)L[L_KN],
                       e[2], slots, kc, vc, q, t, hq, hkv, d);
        for (int64_t j = 0; j < t * qd; j++)
            q[j] *= scale;
        attn_rows(q, kc, vc, keys, off, len, att, t, hq, hkv, d, maxlen);
        q4_linear(&c, L[L_O], L[L_O_B], L[L_INT8] & 2, att, t, qd, hid, h);
        add_rmsnorm(h, res, (const float *)(intptr_t)L[L_LN2], e[1], res, x, t, hid);
        q4_linear(&c, L[L_GU], L[L_GU_B], L[L_INT8] & 4, x, t, hid, 2 * inter, gu);
        silu_mul(gu, act, t, inter);
        q4_linear(&c, L[L_DOWN], L[L_DOWN_B], L[L_INT8] & 8, act, t, inter, hid, h);
    }
}
