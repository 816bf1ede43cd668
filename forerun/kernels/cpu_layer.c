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

/* q [T, Hq, D] (pre-scaled by the softmax scale); kc, vc [S, Hkv, D] (S cache slots); row r sees the keys at the
 * slots keys[off[r] .. off[r] + len[r]) in that order; out [T, Hq, D]. Work item (row, kv head): its g = Hq / Hkv
 * query heads against the kv head's keys: scores, softmax (max, exp, sum in key order), weighted sum of values. */
void attn_rows(const float *q, const float *kc, const float *vc, const int64_t *keys, const int64_t *off,
               const int64_t *len, float *out, int64_t t, int64_t hq, int64_t hkv, int64_t d, int64_t maxlen) {
    const int64_t g = hq / hkv;
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
