/* perception-factory native CPU kernels (kernels/native.py builds and loads this file; docs/KERNELS.md).
 *
 * GroupNorm + ReLU, forward and backward, on channels-last activations: a [B, C, H, W] tensor in
 * channels-last memory is [B, HW, C] rows, one row of C contiguous channels per pixel. Inputs and
 * outputs are float32 or bfloat16 (dtype code 0 = float32, 1 = bfloat16); statistics, sums and the
 * arithmetic are float32 per element with float64 accumulators. The reference is PyTorch's
 * relu(group_norm(x.float())) and its autograd (tests/kernels/test_native.py).
 *
 * Work is split into B x T items (T = threads, the pixels of a sample cut into T chunks) whose partial
 * sums are reduced in a fixed order, so results are bitwise reproducible for a given thread count.
 * OpenMP: the process's libgomp (PyTorch's, already loaded, same soname), so no second thread pool.
 *
 * The exported `pfk_*` prototypes are the binding's declarations: kernels/native.py parses them from this
 * file and calls each kernel by parameter name, checking every argument against its C type (a tensor of
 * the pointee's dtype for a pointer, an int for an integer). Conventions it relies on: every `void *NAME`
 * buffer (float32 or bfloat16) is followed by `int NAME_dt`, its dtype code, and `int nthreads` is the
 * OpenMP thread count; the binding fills both in. A prototype is one declaration ending in `) {`.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define MAX_C 1024

static inline float bf16_to_f32(uint16_t v) {
    uint32_t u = (uint32_t)v << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

/* Round to nearest even, as c10::BFloat16; NaN stays a (quiet) NaN. */
static inline uint16_t f32_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40u);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

static inline void load_row(const void *base, int dt, int64_t offset, int64_t c, float *restrict dst) {
    if (dt == 0) {
        memcpy(dst, (const float *)base + offset, (size_t)c * sizeof(float));
    } else {
        const uint16_t *src = (const uint16_t *)base + offset;
        for (int64_t i = 0; i < c; ++i) dst[i] = bf16_to_f32(src[i]);
    }
}

static inline void store_row(void *base, int dt, int64_t offset, int64_t c, const float *restrict src) {
    if (dt == 0) {
        memcpy((float *)base + offset, src, (size_t)c * sizeof(float));
    } else {
        uint16_t *dst = (uint16_t *)base + offset;
        for (int64_t i = 0; i < c; ++i) dst[i] = f32_to_bf16(src[i]);
    }
}

static inline void chunk(int64_t hw, int64_t t, int64_t nt, int64_t *p0, int64_t *p1) {
    *p0 = hw * t / nt;
    *p1 = hw * (t + 1) / nt;
}

/* GroupNorm's per-(sample, channel) affine: y = x * a + d with a = rstd * w, d = b - mean * a; scale
 * [B, 2, C] gets (a, d). The forward and the backward (which recomputes the ReLU mask from x * a + d)
 * both call this, so the mask is the forward's bit for bit. */
static void gn_affine(const float *mean, const float *rstd, const float *weight, const float *bias, int64_t B,
                      int64_t C, int64_t G, float *scale) {
    const int64_t cg = C / G;
    for (int64_t b = 0; b < B; ++b) {
        for (int64_t c = 0; c < C; ++c) {
            const float a = rstd[b * G + c / cg] * weight[c];
            scale[b * 2 * C + c] = a;
            scale[b * 2 * C + C + c] = bias[c] - mean[b * G + c / cg] * a;
        }
    }
}

/* out = relu(group_norm(x)): x rows at x + b*xsb + p*xsp (elements), out contiguous [B, HW, C].
 * mean, rstd [B, G] float32 are written (saved for the backward). Returns 0, or 1 on bad sizes. */
int pfk_group_norm_relu_fwd(const void *x, int x_dt, int64_t xsb, int64_t xsp, void *out, int out_dt,
                            const float *weight, const float *bias, float *mean, float *rstd, int64_t B,
                            int64_t HW, int64_t C, int64_t G, float eps, int nthreads) {
    if (C > MAX_C || C % G || B <= 0 || HW <= 0 || nthreads <= 0) return 1;
    const int64_t nt = HW >= 1024 ? nthreads : 1;
    const int64_t items = B * nt, cg = C / G;
    double *part = (double *)calloc((size_t)(items * 2 * C), sizeof(double));
    float *scale = (float *)malloc((size_t)(B * 2 * C) * sizeof(float));
    if (!part || !scale) {
        free(part);
        free(scale);
        return 2;
    }
#pragma omp parallel for num_threads(nthreads) schedule(static)
    for (int64_t it = 0; it < items; ++it) {
        const int64_t b = it / nt;
        int64_t p0, p1;
        chunk(HW, it % nt, nt, &p0, &p1);
        double *restrict s = part + it * 2 * C, *restrict ss = s + C;
        float row[MAX_C];
        for (int64_t p = p0; p < p1; ++p) {
            load_row(x, x_dt, b * xsb + p * xsp, C, row);
            for (int64_t c = 0; c < C; ++c) {
                s[c] += row[c];
                ss[c] += (double)row[c] * row[c];
            }
        }
    }
    for (int64_t b = 0; b < B; ++b) {
        for (int64_t g = 0; g < G; ++g) {
            double s = 0.0, ss = 0.0;
            for (int64_t t = 0; t < nt; ++t) {
                const double *ps = part + (b * nt + t) * 2 * C;
                for (int64_t c = g * cg; c < (g + 1) * cg; ++c) {
                    s += ps[c];
                    ss += ps[C + c];
                }
            }
            const double n = (double)(cg * HW);
            const double m = s / n;
            double var = ss / n - m * m;
            if (var < 0.0) var = 0.0;
            mean[b * G + g] = (float)m;
            rstd[b * G + g] = (float)(1.0 / sqrt(var + (double)eps));
        }
    }
    gn_affine(mean, rstd, weight, bias, B, C, G, scale);
#pragma omp parallel for num_threads(nthreads) schedule(static)
    for (int64_t it = 0; it < items; ++it) {
        const int64_t b = it / nt;
        int64_t p0, p1;
        chunk(HW, it % nt, nt, &p0, &p1);
        const float *a = scale + b * 2 * C, *d = a + C;
        float row[MAX_C];
        for (int64_t p = p0; p < p1; ++p) {
            load_row(x, x_dt, b * xsb + p * xsp, C, row);
            for (int64_t c = 0; c < C; ++c) {
                const float y = row[c] * a[c] + d[c];
                row[c] = y > 0.0f ? y : 0.0f;
            }
            store_row(out, out_dt, (b * HW + p) * C, C, row);
        }
    }
    free(part);
    free(scale);
    return 0;
}

/* Backward of out = relu(group_norm(x)). grad rows at grad + b*gsb + p*gsp (a channel slice of a wider
 * gradient is fine); x contiguous [B, HW, C]; dx contiguous [B, HW, C] in dx_dt; dweight, dbias [C]
 * float32 are written. The ReLU passes the gradient where the forward's pre-activation x * a + d was > 0,
 * recomputed from x with the forward's own a, d (the same float operations: the same signs), so `out`
 * is not read: two arrays per pass instead of three. The GroupNorm part is ATen's formula:
 * dx = c1 * g + c2 * x + c3 with per-(sample, group) c2, c3. Returns 0, or 1 on bad sizes. */
int pfk_group_norm_relu_bwd(const void *grad, int grad_dt, int64_t gsb, int64_t gsp, const void *x, int x_dt,
                            const float *mean, const float *rstd, const float *weight, const float *bias,
                            void *dx, int dx_dt, float *dweight, float *dbias, int64_t B, int64_t HW, int64_t C,
                            int64_t G, int nthreads) {
    if (C > MAX_C || C % G || B <= 0 || HW <= 0 || nthreads <= 0) return 1;
    const int64_t nt = HW >= 1024 ? nthreads : 1;
    const int64_t items = B * nt, cg = C / G;
    double *part = (double *)calloc((size_t)(items * 2 * C), sizeof(double));
    float *coef = (float *)malloc((size_t)(B * 3 * C) * sizeof(float));
    double *sums = (double *)calloc((size_t)(B * 2 * C), sizeof(double));
    float *scale = (float *)malloc((size_t)(B * 2 * C) * sizeof(float));
    if (!part || !coef || !sums || !scale) {
        free(part);
        free(coef);
        free(sums);
        free(scale);
        return 2;
    }
    gn_affine(mean, rstd, weight, bias, B, C, G, scale); /* the forward's a, d: the same code */
#pragma omp parallel for num_threads(nthreads) schedule(static)
    for (int64_t it = 0; it < items; ++it) {
        const int64_t b = it / nt;
        int64_t p0, p1;
        chunk(HW, it % nt, nt, &p0, &p1);
        double *restrict db = part + it * 2 * C, *restrict ds = db + C;
        const float *restrict a = scale + b * 2 * C, *restrict d = a + C;
        float gr[MAX_C], xr[MAX_C];
        for (int64_t p = p0; p < p1; ++p) {
            load_row(grad, grad_dt, b * gsb + p * gsp, C, gr);
            load_row(x, x_dt, (b * HW + p) * C, C, xr);
            for (int64_t c = 0; c < C; ++c) gr[c] = xr[c] * a[c] + d[c] > 0.0f ? gr[c] : 0.0f; /* ReLU mask */
            for (int64_t c = 0; c < C; ++c) {
                db[c] += gr[c];
                ds[c] += (double)gr[c] * xr[c];
            }
        }
    }
    const double inv_n = 1.0 / (double)(cg * HW);
    for (int64_t b = 0; b < B; ++b) {
        double *db = sums + b * 2 * C, *ds = db + C;
        for (int64_t t = 0; t < nt; ++t) {
            const double *pp = part + (b * nt + t) * 2 * C;
            for (int64_t c = 0; c < 2 * C; ++c) db[c] += pp[c];
        }
        for (int64_t g = 0; g < G; ++g) {
            const double m = mean[b * G + g], r = rstd[b * G + g];
            double dsg = 0.0, dbg = 0.0;
            for (int64_t c = g * cg; c < (g + 1) * cg; ++c) {
                dsg += ds[c] * weight[c];
                dbg += db[c] * weight[c];
            }
            const double c2 = (dbg * m - dsg) * r * r * r * inv_n;
            const double c3 = -c2 * m - dbg * r * inv_n;
            for (int64_t c = g * cg; c < (g + 1) * cg; ++c) {
                coef[b * 3 * C + c] = (float)(r * weight[c]);
                coef[b * 3 * C + C + c] = (float)c2;
                coef[b * 3 * C + 2 * C + c] = (float)c3;
            }
        }
    }
    for (int64_t c = 0; c < C; ++c) {
        double dw = 0.0, dbs = 0.0;
        for (int64_t b = 0; b < B; ++b) {
            const double db = sums[b * 2 * C + c], ds = sums[b * 2 * C + C + c];
            const int64_t g = c / cg;
            dw += (ds - db * mean[b * G + g]) * rstd[b * G + g];
            dbs += db;
        }
        dweight[c] = (float)dw;
        dbias[c] = (float)dbs;
    }
#pragma omp parallel for num_threads(nthreads) schedule(static)
    for (int64_t it = 0; it < items; ++it) {
        const int64_t b = it / nt;
        int64_t p0, p1;
        chunk(HW, it % nt, nt, &p0, &p1);
        const float *c1 = coef + b * 3 * C, *c2 = c1 + C, *c3 = c2 + C;
        const float *restrict a = scale + b * 2 * C, *restrict d = a + C;
        float gr[MAX_C], xr[MAX_C];
        for (int64_t p = p0; p < p1; ++p) {
            load_row(grad, grad_dt, b * gsb + p * gsp, C, gr);
            load_row(x, x_dt, (b * HW + p) * C, C, xr);
            for (int64_t c = 0; c < C; ++c) {
                const float gm = xr[c] * a[c] + d[c] > 0.0f ? gr[c] : 0.0f;
                xr[c] = c1[c] * gm + c2[c] * xr[c] + c3[c];
            }
            store_row(dx, dx_dt, (b * HW + p) * C, C, xr);
        }
    }
    free(part);
    free(coef);
    free(sums);
    free(scale);
    return 0;
}

/* Pillar scatter-max, forward (kernels/pillar_scatter.py, `_pillar_scatter_max_compact` is the spec):
 * features [N, C] float32 contiguous, cell [N] int64 (outside [0, num_cells): dropped) ->
 * canvas [num_cells, C] (canvas_dt: float32 or bfloat16, the maxima rounded once; 0 for an empty cell),
 * and when with_winner: winner_cell [N] int64 (rows 0..M-1: the occupied cells in increasing order,
 * then -1), winner_point [N, C] int32 (per occupied row and channel the lowest point index holding the
 * max, then -1). NaN counts as the largest value (the lowest-index NaN point wins), as torch's amax.
 * rank [num_cells] int32 is scratch. Returns M (>= 0), or -1 on bad sizes. */
/* The compact scatter-max shared by the kernels below: rank [num_cells] (scratch) gets each occupied
 * cell's row (cells in increasing order), occupied [M] (when not NULL) the cell of each row, seg [M, C]
 * the maxima and win [M, C] the lowest point index holding each (NaN the largest). Returns M. */
static int64_t scatter_compact(const float *feat, const int64_t *cell, int64_t N, int64_t C, int64_t num_cells,
                               int32_t *rank, float *seg, int32_t *win, int64_t *occupied) {
    for (int64_t k = 0; k < num_cells; ++k) rank[k] = -1;
    for (int64_t n = 0; n < N; ++n) {
        const int64_t k = cell[n];
        if (k >= 0 && k < num_cells) rank[k] = 0;
    }
    int64_t M = 0;
    for (int64_t k = 0; k < num_cells; ++k) {
        if (rank[k] == 0) {
            if (occupied) occupied[M] = k;
            rank[k] = (int32_t)M++;
        }
    }
    for (int64_t i = 0; i < M * C; ++i) win[i] = -1;
    for (int64_t n = 0; n < N; ++n) {
        const int64_t k = cell[n];
        if (k < 0 || k >= num_cells) continue;
        const int64_t r = rank[k];
        float *restrict s = seg + r * C;
        int32_t *restrict w = win + r * C;
        const float *restrict f = feat + n * C;
        for (int64_t c = 0; c < C; ++c) {
            const float v = f[c], cur = s[c];
            const int take = (w[c] < 0) | (v > cur) | ((v != v) & (cur == cur));
            s[c] = take ? v : cur;
            w[c] = take ? (int32_t)n : w[c];
        }
    }
    return M;
}

int64_t pfk_scatter_max_fwd(const float *feat, const int64_t *cell, int64_t N, int64_t C, int64_t num_cells,
                            void *canvas, int canvas_dt, int with_winner, int64_t *winner_cell,
                            int32_t *winner_point, int32_t *rank, float *seg, int nthreads) {
    if (C > MAX_C || N < 0 || num_cells < 0) return -1;
    int32_t *win = winner_point; /* [M, C] rows of the winner table (with_winner), else scratch */
    int32_t *own = NULL;
    if (!with_winner) {
        own = (int32_t *)malloc((size_t)(N * C + 1) * sizeof(int32_t));
        if (!own) return -1;
        win = own;
    }
    const int64_t M = scatter_compact(feat, cell, N, C, num_cells, rank, seg, win, with_winner ? winner_cell : NULL);
    free(own);
    const size_t esize = canvas_dt == 0 ? 4 : 2;
#pragma omp parallel for num_threads(nthreads) schedule(static)
    for (int64_t k = 0; k < num_cells; ++k) {
        const int64_t r = rank[k];
        if (r < 0)
            memset((char *)canvas + (size_t)k * C * esize, 0, (size_t)C * esize);
        else
            store_row(canvas, canvas_dt, k * C, C, seg + r * C);
    }
    if (with_winner) {
        for (int64_t i = M; i < N; ++i) winner_cell[i] = -1;
        for (int64_t i = M * C; i < N * C; ++i) winner_point[i] = -1;
    }
    return M;
}

/* Pillar scatter-max, backward: grad_features [N, C] (float32 or bfloat16) = 0, then for each occupied
 * row m < M and channel c, grad_features[winner_point[m, c], c] = grad_canvas[winner_cell[m], c], where
 * grad_canvas rows are at grad_canvas + cell * row_stride (elements; channels contiguous). Each
 * (point, channel) wins at most one cell: no write conflicts. Returns 0, or 1 on bad sizes. */
int pfk_scatter_max_bwd(const void *grad_canvas, int grad_canvas_dt, int64_t row_stride,
                        const int64_t *winner_cell, const int32_t *winner_point, int64_t M, int64_t N, int64_t C,
                        void *grad_features,
                        int grad_features_dt) {
    if (C > MAX_C || M < 0 || M > N) return 1;
    const size_t esize = grad_features_dt == 0 ? 4 : 2;
    memset(grad_features, 0, (size_t)(N * C) * esize);
    float row[MAX_C];
    for (int64_t m = 0; m < M; ++m) {
        load_row(grad_canvas, grad_canvas_dt, winner_cell[m] * row_stride, C, row);
        const int32_t *w = winner_point + m * C;
        if (grad_features_dt == 0) {
            float *g = (float *)grad_features;
            for (int64_t c = 0; c < C; ++c) g[(int64_t)w[c] * C + c] = row[c];
        } else {
            uint16_t *g = (uint16_t *)grad_features;
            for (int64_t c = 0; c < C; ++c) g[(int64_t)w[c] * C + c] = f32_to_bf16(row[c]);
        }
    }
    return 0;
}

/* acc[0..nb) += sum_ci x[ci] * w[ci * ldw + 0..nb): one or two 16-float register blocks (nb = 16 or 32),
 * so the sums stay in registers over the C-long loop instead of a load/store per input channel. */
static inline void axpy_blocks(float *restrict acc, const float *restrict x, const float *restrict w, int64_t C,
                               int64_t ldw, int nb) {
    float a0[16], a1[16];
    for (int j = 0; j < 16; ++j) {
        a0[j] = acc[j];
        a1[j] = nb > 16 ? acc[16 + j] : 0.0f;
    }
    for (int64_t ci = 0; ci < C; ++ci) {
        const float v = x[ci];
        if (v == 0.0f) continue; /* after the pillar MLP's ReLU many are */
        const float *restrict wr = w + ci * ldw;
        for (int j = 0; j < 16; ++j) a0[j] += v * wr[j];
        if (nb > 16)
            for (int j = 0; j < 16; ++j) a1[j] += v * wr[16 + j];
    }
    for (int j = 0; j < 16; ++j) acc[j] = a0[j];
    if (nb > 16)
        for (int j = 0; j < 16; ++j) acc[16 + j] = a1[j];
}

/* The BEV stem, sparse: a 3x3, stride-2, padding-1 convolution (no bias) of the pillar canvas, computed
 * from the occupied pillars only, fused with the scatter-max that makes the canvas.
 * feat [N, C] float32, cell [N] int64 (b*H*W + row*W + col; outside [0, B*H*W): dropped) -> the canvas
 * rows seg [M, C] (maxima; rounded to bfloat16 values when round_bf16, what a bf16 canvas holds),
 * occupied [M] int64, win [M, C] int32 (the winner table; seg, occupied and win have N rows: occupied's
 * rows from M on are set to -1, seg's and win's are not written), and acc [B, Ho, Wo, Cp] float32 (zeroed by
 * the caller) += conv2d(canvas, weight, stride 2, padding 1) in channels-last rows.
 * wt [9, C, Cp] float32 is the weight as [ky*3+kx][c_in][c_out], c_out padded with zeros to Cp, a
 * multiple of 16. An input pixel (iy, ix) reaches output row oy = (iy + 1 - ky) / 2 for the taps ky of
 * its parity (iy even: ky = 1; odd: ky = 0, 2), so each pillar costs 1-4 taps of C x Cp and an empty
 * pillar nothing: the dense conv's work times the occupancy (~6% of the default canvas). Samples run in
 * parallel (their pillars are disjoint rows); within one, pillars add in increasing cell order:
 * deterministic. Returns M, or -1. */
int64_t pfk_pillar_stem_fwd(const float *feat, const int64_t *cell, int64_t N, int64_t C, int64_t B, int64_t H,
                            int64_t W, const float *wt, int64_t Cp, int64_t Ho, int64_t Wo, int round_bf16,
                            float *acc, float *seg, int64_t *occupied, int32_t *win, int32_t *rank,
                            int64_t *first, int nthreads) {
    if (C > MAX_C || Cp > MAX_C || Cp % 16 || N < 0 || B <= 0) return -1;
    const int64_t M = scatter_compact(feat, cell, N, C, B * H * W, rank, seg, win, occupied);
    if (round_bf16)
        for (int64_t i = 0; i < M * C; ++i) seg[i] = bf16_to_f32(f32_to_bf16(seg[i]));
    for (int64_t b = 0, m = 0; b <= B; ++b) { /* first[b]: the first row of sample b (cells sample-major) */
        while (m < M && occupied[m] < b * H * W) ++m;
        first[b] = m;
    }
    for (int64_t i = M; i < N; ++i) occupied[i] = -1; /* seg and win rows >= M stay unwritten (~20 MB) */
#pragma omp parallel for num_threads(nthreads) schedule(dynamic, 1)
    for (int64_t b = 0; b < B; ++b) {
        for (int64_t m = first[b]; m < first[b + 1]; ++m) {
            const int64_t k = occupied[m] - b * H * W, iy = k / W, ix = k % W;
            for (int64_t ky = 0; ky < 3; ++ky) {
                const int64_t ty = iy + 1 - ky;
                if (ty < 0 || (ty & 1) || ty / 2 >= Ho) continue;
                for (int64_t kx = 0; kx < 3; ++kx) {
                    const int64_t tx = ix + 1 - kx;
                    if (tx < 0 || (tx & 1) || tx / 2 >= Wo) continue;
                    float *o = acc + ((b * Ho + ty / 2) * Wo + tx / 2) * Cp;
                    const float *w = wt + (ky * 3 + kx) * C * Cp;
                    for (int64_t co = 0; co < Cp; co += 32)
                        axpy_blocks(o + co, seg + m * C, w + co, C, Cp, Cp - co >= 32 ? 32 : 16);
                }
            }
        }
    }
    return M;
}

/* Backward of pfk_pillar_stem_fwd. grad rows [B, Ho, Wo, Cout] at grad + b*gsb + pixel*gsp (grad_dt) ->
 * grad_feat [N, C] float32 (0 except at each pillar's winners: the canvas gradient at the occupied cells,
 * rounded to bfloat16 first when round_bf16, as a bf16 canvas' gradient is), dwt [B, 9, C, Cp] float32
 * (per-sample partials of the weight's gradient in wt's layout, zeroed by the caller, who adds them in
 * sample order: the same sums whichever thread ran a sample). wtt [9, Cout, Cq] is the weight as
 * [tap][c_out][c_in], c_in padded with zeros to Cq (a multiple of 16). */
int pfk_pillar_stem_bwd(const void *grad, int grad_dt, int64_t gsb, int64_t gsp, const float *seg,
                        const int64_t *occupied, const int32_t *win, const int64_t *first, int64_t M, int64_t N,
                        int64_t C, int64_t B, int64_t H, int64_t W, const float *wtt, int64_t Cout, int64_t Cp,
                        int64_t Cq, int64_t Ho, int64_t Wo, int round_bf16, float *grad_feat, float *dwt,
                        int nthreads) {
    if (C > MAX_C || Cout > Cp || Cp > MAX_C || Cq > MAX_C || Cq % 16 || M < 0 || M > N || B <= 0) return 1;
    memset(grad_feat, 0, (size_t)(N * C) * sizeof(float));
#pragma omp parallel num_threads(nthreads)
    {
#pragma omp for schedule(dynamic, 1)
        for (int64_t b = 0; b < B; ++b) {
            float *restrict dw_t = dwt + b * 9 * C * Cp;
            float g[MAX_C], dx[MAX_C];
            for (int64_t m = first[b]; m < first[b + 1]; ++m) {
                const int64_t k = occupied[m] - b * H * W, iy = k / W, ix = k % W;
                const float *restrict x = seg + m * C;
                for (int64_t ci = 0; ci < Cq; ++ci) dx[ci] = 0.0f;
                for (int64_t ky = 0; ky < 3; ++ky) {
                    const int64_t ty = iy + 1 - ky;
                    if (ty < 0 || (ty & 1) || ty / 2 >= Ho) continue;
                    for (int64_t kx = 0; kx < 3; ++kx) {
                        const int64_t tx = ix + 1 - kx;
                        if (tx < 0 || (tx & 1) || tx / 2 >= Wo) continue;
                        const int64_t tap = ky * 3 + kx;
                        load_row(grad, grad_dt, b * gsb + (ty / 2 * Wo + tx / 2) * gsp, Cout, g);
                        for (int64_t ci = 0; ci < Cq; ci += 32) /* dx += W_tap^T g */
                            axpy_blocks(dx + ci, g, wtt + tap * Cout * Cq + ci, Cout, Cq, Cq - ci >= 32 ? 32 : 16);
                        float *restrict dwk = dw_t + tap * C * Cp;
                        for (int64_t ci = 0; ci < C; ++ci) { /* dW_tap += x g^T */
                            const float v = x[ci];
                            if (v == 0.0f) continue;
                            float *restrict dwr = dwk + ci * Cp;
                            for (int64_t co = 0; co < Cout; ++co) dwr[co] += v * g[co];
                        }
                    }
                }
                const int32_t *wm = win + m * C;
                for (int64_t ci = 0; ci < C; ++ci)
                    grad_feat[(int64_t)wm[ci] * C + ci] = round_bf16 ? bf16_to_f32(f32_to_bf16(dx[ci])) : dx[ci];
            }
        }
    }
    return 0;
}
