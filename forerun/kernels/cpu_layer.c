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

/* ---- Attention in items of rows, W keys at a time (W = 16 with AVX-512, 8 with AVX2; session 43) ----
 * The scalar loop below (one row at a time) spent most of a long prompt's prefill streaming every key and value from
 * L3 for each row, in one horizontal sum per key and head, and in expf (Qwen2.5-1.5B, 2,048 tokens, 2 threads: ~14
 * s of a 25.6 s forward). Per row and query head the operations and their order depend on that row alone, so a row
 * gives the same bits alone or in any item (batch invariance); the two builds differ from each other (vector width:
 * another score tree), as their products do. */
#ifdef __AVX512F__
#define W 16
typedef __m512 vec;
typedef __mmask16 vmask;
#define VZERO() _mm512_setzero_ps()
#define VSET(x) _mm512_set1_ps(x)
#define VLOAD(p) _mm512_loadu_ps(p)
#define VSTORE(p, v) _mm512_storeu_ps((p), (v))
#define VFMA(a, b, c) _mm512_fmadd_ps((a), (b), (c))
#define VADD(a, b) _mm512_add_ps((a), (b))
#define VSUB(a, b) _mm512_sub_ps((a), (b))
#define VMUL(a, b) _mm512_mul_ps((a), (b))
#define VMAX(a, b) _mm512_max_ps((a), (b))
#define VMASK(n) ((vmask)((n) < 16 ? (1u << (n)) - 1 : 0xFFFF))  /* the first n lanes */
#define VLOADM(p, m, fill) _mm512_mask_loadu_ps(VSET(fill), (m), (p))
#define VSTOREM(p, m, v) _mm512_mask_storeu_ps((p), (m), (v))
#define VKEEP(m, v) _mm512_maskz_mov_ps((m), (v))
#define VREDMAX(v) _mm512_reduce_max_ps(v)
#define VREDADD(v) _mm512_reduce_add_ps(v)

/* lane j of the result = the sum of a[j]'s lanes, in a fixed tree */
static inline vec vhsum(const vec *a) {
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

static inline vec vexp(vec x) {  /* exp8 on each half */
    const __m256 lo = exp8(_mm512_castps512_ps256(x));
    const __m256 hi = exp8(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(x), 1)));
    return _mm512_castpd_ps(_mm512_insertf64x4(_mm512_castpd256_pd512(_mm256_castps_pd(lo)), _mm256_castps_pd(hi), 1));
}
#else
#define W 8
typedef __m256 vec;
typedef __m256i vmask;
#define VZERO() _mm256_setzero_ps()
#define VSET(x) _mm256_set1_ps(x)
#define VLOAD(p) _mm256_loadu_ps(p)
#define VSTORE(p, v) _mm256_storeu_ps((p), (v))
#define VFMA(a, b, c) _mm256_fmadd_ps((a), (b), (c))
#define VADD(a, b) _mm256_add_ps((a), (b))
#define VSUB(a, b) _mm256_sub_ps((a), (b))
#define VMUL(a, b) _mm256_mul_ps((a), (b))
#define VMAX(a, b) _mm256_max_ps((a), (b))
#define VMASK(n) _mm256_cmpgt_epi32(_mm256_set1_epi32((int)(n)), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7))
#define VLOADM(p, m, fill) _mm256_blendv_ps(VSET(fill), _mm256_maskload_ps((p), (m)), _mm256_castsi256_ps(m))
#define VSTOREM(p, m, v) _mm256_maskstore_ps((p), (m), (v))
#define VKEEP(m, v) _mm256_and_ps(_mm256_castsi256_ps(m), (v))
static inline float vred(__m256 v, int mx) {  /* fixed order: halves, then pairs */
    __m128 s = mx ? _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1))
                  : _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = mx ? _mm_max_ps(s, _mm_movehl_ps(s, s)) : _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(mx ? _mm_max_ss(s, _mm_movehdup_ps(s)) : _mm_add_ss(s, _mm_movehdup_ps(s)));
}
#define VREDMAX(v) vred((v), 1)
#define VREDADD(v) vred((v), 0)

static inline vec vhsum(const vec *a) {  /* lane j = the sum of a[j]'s 8 lanes */
    const __m256 t0 = _mm256_hadd_ps(a[0], a[1]), t1 = _mm256_hadd_ps(a[2], a[3]);
    const __m256 t2 = _mm256_hadd_ps(a[4], a[5]), t3 = _mm256_hadd_ps(a[6], a[7]);
    const __m256 u0 = _mm256_hadd_ps(t0, t1), u1 = _mm256_hadd_ps(t2, t3);  /* [a0..a3 | a0..a3], [a4..a7 | ..] */
    return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}

#define vexp exp8
#endif

/* One work item: rows r0 .. r0 + nr - 1 (nr <= ATTN_RB, consecutive rows whose keys start at the same place: the
 * same sequence's key list) x kv head h, head size d = W * dv (attn_item_for: dv 4, 8 or 16). A row sees its own first
 * len[r] keys, W at a time; the rows of the item share each tile of W keys (and of W values) while it is in L1: one
 * row at a time streamed every key and value of a long prompt from L3 for each row (2,048 rows: 2 x 1 MB per row
 * and kv head). Scores: per key one accumulator over the head in W-float pieces, the tile's W sums in one vhsum;
 * softmax over the row's own keys in key order; values summed per output piece in key order, up to 8 vectors at a
 * time in registers. sc [ATTN_RB][g][maxlen] scores, ob [ATTN_RB][g][d]. */
#define ATTN_RB 16
#define INLINE static inline __attribute__((always_inline))
INLINE void attn_item_body(const float *q, const float *kc, const float *vc, const int64_t *ks, const int64_t *len,
                           int64_t r0, int64_t nr, int64_t hq, int64_t g, int64_t h, int64_t hkv, int64_t maxlen,
                           float *sc, float *ob, float *out, const int dv) {
    const int64_t d = (int64_t)W * dv;
    int64_t longest = 0;
    for (int64_t r = 0; r < nr; r++) longest = len[r0 + r] > longest ? len[r0 + r] : longest;
    for (int64_t j0 = 0; j0 < longest; j0 += W) {  /* scores, tile by tile */
        for (int64_t r = 0; r < nr; r++) {
            const int64_t n = len[r0 + r];
            if (j0 >= n) continue;
            const int64_t nb = n - j0 < W ? n - j0 : W;
            const float *kp[W];  /* the tile's keys (past the row's last one: its first again, lanes masked off) */
            for (int jj = 0; jj < W; jj++) kp[jj] = kc + (ks[j0 + (jj < nb ? jj : 0)] * hkv + h) * d;
            for (int64_t i = 0; i < g; i++) {
                const float *qi = q + ((r0 + r) * hq + h * g + i) * d;
                vec acc[W];
                for (int jj = 0; jj < W; jj++) acc[jj] = VZERO();
                for (int c = 0; c < dv; c++) {
                    const vec qc = VLOAD(qi + W * c);
                    for (int jj = 0; jj < W; jj++) acc[jj] = VFMA(qc, VLOAD(kp[jj] + W * c), acc[jj]);
                }
                VSTOREM(sc + (r * g + i) * maxlen + j0, VMASK(nb), vhsum(acc));
            }
        }
    }
    float inv[ATTN_RB * 16];
    for (int64_t r = 0; r < nr; r++) {  /* softmax of each row and head over its own keys, in key order */
        const int64_t n = len[r0 + r];
        for (int64_t i = 0; i < g; i++) {
            float *si = sc + (r * g + i) * maxlen;
            vec mx = VSET(-INFINITY), sum = VZERO();
            for (int64_t j0 = 0; j0 < n; j0 += W)
                mx = VMAX(mx, VLOADM(si + j0, VMASK(n - j0), -INFINITY));
            const vec m = VSET(VREDMAX(mx));
            for (int64_t j0 = 0; j0 < n; j0 += W) {
                const vmask mk = VMASK(n - j0);
                const vec e = VKEEP(mk, vexp(VSUB(VLOADM(si + j0, mk, 0.f), m)));
                VSTOREM(si + j0, mk, e);
                sum = VADD(sum, e);
            }
            inv[r * g + i] = 1.f / VREDADD(sum);
        }
    }
    memset(ob, 0, sizeof(float) * (size_t)(nr * g * d));
    for (int64_t j0 = 0; j0 < longest; j0 += W) {  /* weighted values, tile by tile, each row's in key order */
        for (int64_t r = 0; r < nr; r++) {
            const int64_t n = len[r0 + r];
            if (j0 >= n) continue;
            const int64_t j1 = n - j0 < W ? n : j0 + W;
            for (int64_t i = 0; i < g; i++) {
                const float *si = sc + (r * g + i) * maxlen;
                float *oi = ob + (r * g + i) * d;
                for (int c0 = 0; c0 < dv; c0 += 8) {  /* up to 8 vectors of the output in registers */
                    const int nc = dv - c0 < 8 ? dv - c0 : 8;
                    vec o[8];
                    for (int c = 0; c < nc; c++) o[c] = VLOAD(oi + W * (c0 + c));
                    for (int64_t j = j0; j < j1; j++) {
                        const vec p = VSET(si[j]);
                        const float *vj = vc + (ks[j] * hkv + h) * d + W * c0;
                        for (int c = 0; c < nc; c++) o[c] = VFMA(p, VLOAD(vj + W * c), o[c]);
                    }
                    for (int c = 0; c < nc; c++) VSTORE(oi + W * (c0 + c), o[c]);
                }
            }
        }
    }
    for (int64_t r = 0; r < nr; r++)
        for (int64_t i = 0; i < g; i++) {
            const vec iv = VSET(inv[r * g + i]);
            const float *oi = ob + (r * g + i) * d;
            float *dst = out + ((r0 + r) * hq + h * g + i) * d;
            for (int c = 0; c < dv; c++) VSTORE(dst + W * c, VMUL(VLOAD(oi + W * c), iv));
        }
}

/* the item for D = W * DV, DV a constant (loops unrolled, accumulators in registers) */
#define ATTN_ITEM(DV)                                                                                               \
    static void attn_item_##DV(const float *q, const float *kc, const float *vc, const int64_t *ks,                  \
                               const int64_t *len, int64_t r0, int64_t nr, int64_t hq, int64_t g, int64_t h,         \
                               int64_t hkv, int64_t maxlen, float *sc, float *ob, float *out) {                      \
        attn_item_body(q, kc, vc, ks, len, r0, nr, hq, g, h, hkv, maxlen, sc, ob, out, DV);                          \
    }
ATTN_ITEM(4)   /* D = 64 (AVX-512: SmolLM2, Qwen2.5-0.5B) or 32 (AVX2) */
ATTN_ITEM(8)   /* D = 128 (AVX-512: Qwen2.5-1.5B, Llama, Qwen3) or 64 (AVX2) */
ATTN_ITEM(16)  /* D = 256 (AVX-512) or 128 (AVX2) */
typedef void (*attn_item_fn)(const float *, const float *, const float *, const int64_t *, const int64_t *, int64_t,
                             int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, float *, float *, float *);
static attn_item_fn attn_item_for(int64_t d) {
    return d == 4 * W ? attn_item_4 : d == 8 * W ? attn_item_8 : d == 16 * W ? attn_item_16 : NULL;
}

static int attn_blocked = 1;  /* 0: every row on the scalar loop below (benchmarks/prefill_cpu.py compares) */
int attn_rows_blocked(int on) {  /* sets it when on >= 0; returns the setting in force */
    if (on >= 0) attn_blocked = on;
    return attn_blocked;
}

void attn_rows(const float *q, const float *kc, const float *vc, const int64_t *keys, const int64_t *off,
               const int64_t *len, float *out, int64_t t, int64_t hq, int64_t hkv, int64_t d, int64_t maxlen) {
    const int64_t g = hq / hkv;
    const attn_item_fn item = attn_item_for(d);
    if (attn_blocked && item != NULL && g <= 16 && maxlen > 0) {
        /* items of up to rb consecutive rows whose keys start at the same place (a row with no key alone); rb <=
         * ATTN_RB, fewer where their scores would pass 32 MB a thread (long contexts) */
        int64_t rb = (int64_t)((32ll << 20) / (4 * g * maxlen));
        rb = rb < 1 ? 1 : rb > ATTN_RB ? ATTN_RB : rb;
        int64_t *start = (int64_t *)malloc(sizeof(int64_t) * (size_t)(t + 1)), items = 0;
        for (int64_t r = 0; r < t; r++)
            if (r == 0 || off[r] != off[r - 1] || r - start[items - 1] >= rb || len[r] == 0 || len[r - 1] == 0)
                start[items++] = r;
        start[items] = t;
#pragma omp parallel
        {
            float *sc = (float *)malloc(sizeof(float) * (size_t)(rb * g * maxlen + 16));
            float *ob = (float *)malloc(sizeof(float) * (size_t)(rb * g * d));
#pragma omp for schedule(dynamic, 1)
            for (int64_t w = 0; w < items * hkv; w++) {
                const int64_t it = w / hkv, h = w % hkv, r0 = start[it], nr = start[it + 1] - r0;
                if (len[r0] == 0) {  /* a row with no visible key: zeros, as below */
                    for (int64_t i = 0; i < g; i++) memset(out + (r0 * hq + h * g + i) * d, 0, sizeof(float) * (size_t)d);
                    continue;
                }
                item(q, kc, vc, keys + off[r0], len, r0, nr, hq, g, h, hkv, maxlen, sc, ob, out);
            }
            free(sc);
            free(ob);
        }
        free(start);
        return;
    }
#pragma omp parallel
    {
        float *sc = (float *)malloc(sizeof(float) * (size_t)(g * (maxlen > 0 ? maxlen : 1)));
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
