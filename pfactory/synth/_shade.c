/* The camera's per-pixel shading in one C loop: pfactory/synth/native.py builds and calls it.
 *
 * pfs_shade is the C twin of the NumPy reference `pfactory.synth.sensors._shade_numpy` (surface(),
 * layout.ground, surface_normals / _prism_normals, _facade_windows, _hash01, Lambert + ambient,
 * Blinn-Phong, _contact_shadow, haze, exposure, the uint8 quantisation): the SAME IEEE operations in
 * the SAME order and precision, so both give byte-identical images (tests/synth/test_synth_native.py).
 * Rules that keep it so:
 * - built with -ffp-contract=off (no FMA) and without -ffast-math;
 * - float32 where NumPy computes in float32, double where NumPy promotes to float64 (a float32 array
 *   with an np.float64 scalar or a float64 array); a Python float constant meeting a float32 array is
 *   rounded double -> float first (NumPy 2's weak scalars), hence F(0.55) and never 0.55f;
 * - np.mod is npy_divmod's remainder (`mod_d`, `mod_f`); np.sign, np.maximum / np.minimum, np.clip and
 *   np.argmax mirror NumPy's NaN and signed-zero rules (checked on NumPy 2.4);
 * - what C cannot reproduce bit for bit (NumPy's SIMD cos/sin/exp) is computed by NumPy and passed in:
 *   the per-primitive yaw cosines and sines, each shadowing box's cos/sin/radius, the haze exponential.
 */
#include <math.h>
#include <stdint.h>

#define F(x) ((float)(x)) /* a Python float constant as NumPy rounds it to float32 */

enum { HIT_GROUND = -1, HIT_NONE = -2 };
enum { KIND_BOX = 0, KIND_CYLINDER = 1, KIND_ELLIPSOID = 2, KIND_PRISM = 3 };
enum { MAT_ASPHALT = 0, MAT_LANE_PAINT = 1, MAT_GLASS = 5, MAT_FACADE = 14, N_MAT = 18 };

/* np.mod (npy_divmod's remainder) for float64 / float32 */
static inline double mod_d(double a, double b) {
    double m = fmod(a, b);
    if (!b) return m;
    if (m) {
        if ((b < 0) != (m < 0)) m += b;
    } else {
        m = copysign(0.0, b);
    }
    return m;
}

static inline float mod_f(float a, float b) {
    float m = fmodf(a, b);
    if (!b) return m;
    if (m) {
        if ((b < 0) != (m < 0)) m += b;
    } else {
        m = copysignf(0.0f, b);
    }
    return m;
}

/* np.sign: +1, -1, +0 for either zero, NaN stays NaN */
static inline float sign_f(float x) { return x > 0 ? 1.0f : (x < 0 ? -1.0f : (x == 0 ? 0.0f : x)); }

/* np.maximum / np.minimum: a NaN in either operand wins; of two equal values (+0 and -0) the second */
static inline float max_f(float a, float b) { return (a != a) ? a : ((b != b) ? b : (a > b ? a : b)); }
static inline double max_d(double a, double b) { return (a != a) ? a : ((b != b) ? b : (a > b ? a : b)); }
static inline double min_d(double a, double b) { return (a != a) ? a : ((b != b) ? b : (a < b ? a : b)); }

/* np.clip(x, lo, hi) for floats: x unless it lies outside [lo, hi] (so -0 stays -0 at lo = +0); NaN stays */
static inline float clip_f(float x, float lo, float hi) { return x < lo ? lo : (x > hi ? hi : x); }
static inline double clip_d(double x, double lo, double hi) { return x < lo ? lo : (x > hi ? hi : x); }

/* Layout.ground at one ground point (float64 x, y: the camera's float32 points promoted, the lidar's as
 * they are). `road`:
 * [cos yaw, sin yaw, stall_offset, then per side (right, left): sign, lane_edge, asphalt_edge,
 * perpendicular (0/1), ground material]; `lines [n_lines, 2]`: (u, dashed 0/1). */
static inline int ground_material(double x, double y, const double *road, int64_t n_lines, const double *lines) {
    double c = road[0], s = road[1];
    double sr = c * x + s * y;
    double u = (-s) * x + c * y;
    int mat = MAT_ASPHALT;
    for (int k = 0; k < 2; k++) {
        const double *sd = road + 3 + 5 * k;
        double a = u * sd[0];
        if (a > sd[2]) mat = (int)sd[4];
        if (sd[3] != 0.0) {
            if (a > sd[1] && a < sd[2] && mod_d(sr - road[2], 2.6) < 0.12) mat = MAT_LANE_PAINT;
        }
    }
    for (int64_t k = 0; k < n_lines; k++) {
        if (fabs(u - lines[2 * k]) < 0.075 && (lines[2 * k + 1] == 0.0 || mod_d(sr, 9.0) < 3.0)) mat = MAT_LANE_PAINT;
    }
    return mat;
}

/* surface_normals (+ _prism_normals) at one point on primitive p: writes the unit normal, returns is_top.
 * `prm [P, 7]` float32 params, `cs [P, 2]` float32 (cos, sin) of the float64 yaw, `taper [P, 2]` float32. */
static inline int prim_normal(float px, float py, float pz, int kind, const float *q, float c, float s,
                              const float *tp, float *n) {
    float dx = px - q[0], dy = py - q[1], dz = pz - q[2];
    float lx = c * dx + s * dy, ly = (-s) * dx + c * dy;
    float hx = 0.5f * q[3], hy = 0.5f * q[4], hz = 0.5f * q[5];
    float nxl, nyl, nzl;
    int top = 0, ell = 0;
    if (kind == KIND_BOX) {
        float qx = fabsf(lx) / hx, qy = fabsf(ly) / hy, qz = fabsf(dz) / hz;
        int on_x = (qx >= qy) && (qx >= qz);
        int on_y = !on_x && (qy >= qz);
        int on_z = !on_x && !on_y;
        nxl = on_x ? sign_f(lx) : 0.0f;
        nyl = on_y ? sign_f(ly) : 0.0f;
        nzl = on_z ? sign_f(dz) : 0.0f;
        top = on_z && (dz > 0);
    } else if (kind == KIND_CYLINDER) {
        float radial = sqrtf(lx * lx + ly * ly);
        int cap = (hz - dz) < (hx - radial);
        float inv_r = 1.0f / max_f(radial, F(1e-9));
        nxl = cap ? 0.0f : lx * inv_r;
        nyl = cap ? 0.0f : ly * inv_r;
        nzl = cap ? 1.0f : 0.0f;
        top = cap;
    } else if (kind == KIND_PRISM) {
        float af = tp[0] / q[5], ar = tp[1] / q[5];
        float inv_f = 1.0f / sqrtf(1.0f + af * af), inv_b = 1.0f / sqrtf(1.0f + ar * ar);
        float d[4] = {
            (lx + af * dz - (hx - af * hz)) * inv_f,
            (-lx + ar * dz - (hx - ar * hz)) * inv_b,
            fabsf(ly) - hy,
            fabsf(dz) - hz,
        };
        int face = 0; /* np.argmax: the first maximum, a NaN counts as the maximum */
        float best = d[0];
        if (best == best) {
            for (int k = 1; k < 4; k++) {
                if (d[k] != d[k]) {
                    face = k;
                    break;
                }
                if (d[k] > best) {
                    best = d[k];
                    face = k;
                }
            }
        }
        nxl = face == 0 ? inv_f : (face == 1 ? -inv_b : 0.0f);
        nyl = face == 2 ? sign_f(ly) : 0.0f;
        nzl = face == 0 ? af * inv_f : (face == 1 ? ar * inv_b : (face == 3 ? sign_f(dz) : 0.0f));
        top = (face == 3) && (dz > 0);
    } else { /* ellipsoid */
        nxl = lx / (hx * hx);
        nyl = ly / (hy * hy);
        nzl = dz / (hz * hz);
        ell = 1;
    }
    float nx = c * nxl - s * nyl, ny = s * nxl + c * nyl;
    float inv_len = 1.0f / max_f(sqrtf(nx * nx + ny * ny + nzl * nzl), F(1e-12));
    n[0] = nx * inv_len;
    n[1] = ny * inv_len;
    n[2] = nzl * inv_len;
    if (ell) top = n[2] > F(0.6);
    return top;
}

/* _facade_windows at one façade-wall point: 1 when it lies on a window pane. `cwf`, `swf`: NumPy's
 * float32 cos/sin of the float32 yaw. */
static inline int facade_window(float px, float py, float pz, const float *q, float cwf, float swf) {
    float d0 = px - q[0], d1 = py - q[1], d2 = pz - q[2];
    float lx = cwf * d0 + swf * d1, ly = (-swf) * d0 + cwf * d1;
    float along = (fabsf(lx) / q[3] > fabsf(ly) / q[4]) ? ly : lx;
    float z = d2 + F(0.5) * q[5];
    float period = F(2.6) + mod_f(q[3] * F(7.31), F(1.2));
    float zf = mod_f(z - F(3.6), F(3.1));
    int upper = (z > F(3.6)) && (mod_f(along, period) < F(0.55) * period) && (zf > F(0.9)) && (zf < F(2.4));
    int shop = (z > F(0.5)) && (z < F(3.0)) && (mod_f(along, 2.0f * period) < F(1.4) * period);
    return (upper || shop) && (z < q[5] - F(0.8));
}

/* _contact_shadow at one ground point: the darkening factor. `shadow [S, 7]` float64 per box:
 * x, y, l, w, cos yaw, sin yaw, radius (0.5 hypot(l, w) + 0.4), all as NumPy computed them. */
static inline float contact_shadow(float gx32, float gy32, int64_t n_shadow, const double *shadow) {
    float f = 1.0f;
    double gx = gx32, gy = gy32;
    for (int64_t k = 0; k < n_shadow; k++) {
        const double *b = shadow + 7 * k;
        double r = b[6];
        if (!(fabs(gx - b[0]) < r && fabs(gy - b[1]) < r)) continue;
        double q0 = gx - b[0], q1 = gy - b[1];
        double c = b[4], s = b[5];
        double lx = fabs(c * q0 + s * q1) - 0.5 * b[2];
        double ly = fabs((-s) * q0 + c * q1) - 0.5 * b[3];
        double outside = hypot(max_d(lx, 0.0), max_d(ly, 0.0));
        double dark = outside > 0 ? 0.45 + 0.55 * clip_d(outside / 0.35, 0.0, 1.0) : 0.4;
        f = (float)min_d((double)f, dark);
    }
    return f;
}

/* What surface() reads: the primitives and the layout (see pfs_shade's comment). */
typedef struct {
    int64_t n_prim;
    const int32_t *kind;
    const float *prm, *yaw, *taper, *color, *reflectance;
    const int32_t *material;
    const double *road;
    int64_t n_lines;
    const double *lines;
    const float *ground_rgb, *ground_refl;
} Tables;

static const float WINDOW_RGB[3] = {F(0.16), F(0.2), F(0.25)};

/* `sensors._surface_numpy` at one hit: ground (p == -1) at float64 (gx, gy), primitive p at float32
 * (px, py, pz). Writes the unit normal n [3] (before any flip towards the viewer), points *rgb at the
 * albedo, sets *refl (when not NULL) to the lidar reflectance; returns the material, or -1 for a
 * primitive or material out of range. */
static inline int surface_point(double gx, double gy, float px, float py, float pz, int32_t p, const Tables *tb,
                                float *n, const float **rgb, float *refl) {
    int mat;
    if (p == HIT_GROUND) {
        n[0] = 0.0f;
        n[1] = 0.0f;
        n[2] = 1.0f;
        mat = ground_material(gx, gy, tb->road, tb->n_lines, tb->lines);
        if (mat < 0 || mat >= N_MAT) return -1;
        *rgb = tb->ground_rgb + 3 * mat;
        if (refl) *refl = tb->ground_refl[mat];
        return mat;
    }
    if (p < 0 || p >= tb->n_prim) return -1;
    const float *q = tb->prm + 7 * (int64_t)p;
    const float *cs = tb->yaw + 4 * (int64_t)p;
    int top = prim_normal(px, py, pz, tb->kind[p], q, cs[0], cs[1], tb->taper + 2 * (int64_t)p, n);
    int64_t flat = 2 * (int64_t)p + top;
    mat = tb->material[flat];
    if (mat < 0 || mat >= N_MAT) return -1;
    *rgb = tb->color + 3 * flat;
    if (refl) *refl = tb->reflectance[flat];
    if (mat == MAT_FACADE && fabsf(n[2]) < F(0.5) && facade_window(px, py, pz, q, cs[2], cs[3])) {
        mat = MAT_GLASS;
        *rgb = WINDOW_RGB;
        if (refl) *refl = F(0.05);
    }
    return mat;
}

/* x**40 as NumPy's reference computes it: repeated squaring, x^32 * x^8 */
static inline float pow40(float x) {
    float x2 = x * x, x4 = x2 * x2, x8 = x4 * x4, x16 = x8 * x8, x32 = x16 * x16;
    return x32 * x8;
}

/* Shade n pixels of one render into out [n, 3] uint8 (before blur and sensor noise).
 *
 * Per pixel: t [n] float64 first-hit depth, prim [n] int32 (-2 sky, -1 ground, else primitive), the
 * camera grid's d32 [n, 3], view [n, 3], w_sky [n] float32, ehaze [n] float32 the haze exponential
 * exp(-(t * d_len) / haze_m) (NumPy's). origin [3] float32. Primitives (n_prim rows): kind [P] int8
 * (stored as int32 here), prm [P, 7] float32 params, yaw [P, 4] float32 (cos, sin of the float64 yaw
 * rounded to float32; cos, sin of the float32 yaw in float32), taper [P, 2] float32, material [P, 2]
 * int32, color [P, 2, 3] float32. road / lines: see ground_material; ground_rgb [N_MAT, 3] float32;
 * mat_tab [N_MAT, 4] float32 (texture amplitude, 1 / texture cell, specular, emission). lf [9] float32:
 * sun [3], ambient, sun_strength, horizon [3], 255 * exposure; ld [6] float64: horizon [3], zenith [3].
 * shadow [n_shadow, 7]: see contact_shadow. Returns 0, or -1 for a primitive or material out of range.
 */
int pfs_shade(int64_t n, const double *t, const int32_t *prim, const float *d32, const float *view,
              const float *w_sky, const float *ehaze, const float *origin, int64_t n_prim, const int32_t *kind,
              const float *prm, const float *yaw, const float *taper, const int32_t *material,
              const float *color, const double *road, int64_t n_lines, const double *lines,
              const float *ground_rgb, const float *mat_tab, const float *lf, const double *ld,
              int64_t n_shadow, const double *shadow, uint8_t *out) {
    const Tables tabs = {n_prim, kind, prm, yaw, taper, color, 0, material, road, n_lines, lines, ground_rgb, 0};
    const float sun0 = lf[0], sun1 = lf[1], sun2 = lf[2], amb = lf[3], ss = lf[4], scale = lf[8];
    int bad = 0;
    for (int64_t i = 0; i < n; i++) {
        int32_t p = prim[i];
        float col[3];
        if (p == HIT_NONE) {
            float w = w_sky[i];
            float om = 1.0f - w;
            for (int ch = 0; ch < 3; ch++) col[ch] = (float)(ld[ch] * (double)om + ld[3 + ch] * (double)w);
        } else {
            float th = (float)t[i];
            const float *d = d32 + 3 * i, *v = view + 3 * i;
            float px = origin[0] + d[0] * th, py = origin[1] + d[1] * th, pz = origin[2] + d[2] * th;
            float n3[3];
            const float *rgb;
            int mat = surface_point((double)px, (double)py, px, py, pz, p, &tabs, n3, &rgb, 0);
            if (mat < 0) {
                bad = 1;
                continue;
            }
            float n_dot_v = n3[0] * v[0] + n3[1] * v[1] + n3[2] * v[2];
            if (n_dot_v < 0) {
                n3[0] = -n3[0];
                n3[1] = -n3[1];
                n3[2] = -n3[2];
            }
            const float *mt = mat_tab + 4 * mat;
            uint32_t h0 = (uint32_t)(int32_t)floorf(px * mt[1]);
            uint32_t h1 = (uint32_t)(int32_t)floorf(py * mt[1]);
            uint32_t h2 = (uint32_t)(int32_t)floorf(pz * mt[1]);
            h0 += (uint32_t)(mat * 7919);
            uint32_t x = (h0 * 73856093u) ^ (h1 * 19349663u) ^ (h2 * 83492791u);
            x ^= x >> 13;
            x *= 0x5BD1E995u;
            x ^= x >> 15;
            float hv = (float)(x & 0xFFFFu) * F(1.0 / 65536.0);
            float tex = 1.0f + mt[0] * (2.0f * hv - 1.0f);
            float ndl = clip_f(n3[0] * sun0 + n3[1] * sun1 + n3[2] * sun2, 0.0f, 1.0f);
            float shade = amb * (F(0.75) + F(0.25) * n3[2]) + ss * ndl;
            float spec = 0.0f;
            if (mt[2] > 0) {
                float h[3] = {sun0 + v[0], sun1 + v[1], sun2 + v[2]};
                float len = sqrtf(h[0] * h[0] + h[1] * h[1] + h[2] * h[2]);
                h[0] /= len;
                h[1] /= len;
                h[2] /= len;
                float n_dot_h = clip_f(n3[0] * h[0] + n3[1] * h[1] + n3[2] * h[2], 0.0f, 1.0f);
                spec = mt[2] * pow40(n_dot_h) * ss;
            }
            float k = tex * shade + mt[3];
            for (int ch = 0; ch < 3; ch++) col[ch] = rgb[ch] * k + spec;
            if (p == HIT_GROUND && n_shadow > 0) {
                float f = contact_shadow(px, py, n_shadow, shadow);
                for (int ch = 0; ch < 3; ch++) col[ch] *= f;
            }
            float haze = 1.0f - ehaze[i];
            float keep = 1.0f - haze;
            for (int ch = 0; ch < 3; ch++) col[ch] = col[ch] * keep + lf[5 + ch] * haze;
        }
        for (int ch = 0; ch < 3; ch++) {
            float vv = clip_f(col[ch] * scale + F(0.5), 0.0f, 255.0f);
            out[3 * i + ch] = (uint8_t)vv;
        }
    }
    return bad ? -1 : 0;
}

/* The optical blur and the sensor noise of `sensors._blur_noise_numpy`, on img [h, w, 3] uint8 (the shaded
 * render) into out [h, w, 3] uint8. Blur: the 3x3 binomial kernel (1 2 1)^T (1 2 1) / 16 rounded half up,
 * (S + 8) >> 4, on interior pixels; the border rows and columns are copied (Pillow's
 * ImageFilter.Kernel((3, 3), (1, 2, 1, 2, 4, 2, 1, 2, 1)) gives the same bytes: its float sums of
 * multiples of 1/16 are exact). Noise: per value one random byte b [h, w, 3], (b & 3) + ((b >> 2) & 3) - 3,
 * added and clipped to 0..255. Returns 0. */
int pfs_blur_noise(int64_t h, int64_t w, const uint8_t *img, const uint8_t *noise, uint8_t *out) {
    const int64_t row = 3 * w;
    int blur = h >= 3 && w >= 3;
    for (int64_t y = 0; y < h; y++) {
        const uint8_t *in0 = img + y * row;
        const uint8_t *b = noise + y * row;
        uint8_t *o = out + y * row;
        if (!blur || y == 0 || y == h - 1) {
            for (int64_t k = 0; k < row; k++) {
                int v = (int)in0[k] + (b[k] & 3) + ((b[k] >> 2) & 3) - 3;
                o[k] = (uint8_t)(v < 0 ? 0 : (v > 255 ? 255 : v));
            }
            continue;
        }
        const uint8_t *up = in0 - row, *dn = in0 + row;
        for (int64_t k = 0; k < row; k++) {
            int v;
            if (k < 3 || k >= row - 3) {
                v = in0[k];
            } else {
                int s = up[k - 3] + 2 * up[k] + up[k + 3] + 2 * (in0[k - 3] + 2 * in0[k] + in0[k + 3]) + dn[k - 3] +
                        2 * dn[k] + dn[k + 3];
                v = (s + 8) >> 4;
            }
            v += (b[k] & 3) + ((b[k] >> 2) & 3) - 3;
            o[k] = (uint8_t)(v < 0 ? 0 : (v > 255 ? 255 : v));
        }
    }
    return 0;
}

/* `sensors._surface_numpy` for n hits: points [n, 3] float64, prim [n] int32 (-1 ground, else primitive);
 * primitive and layout tables as pfs_shade's, plus reflectance [P, 2] and ground_refl [N_MAT] float32.
 * Writes normals [n, 3] float32, mat [n] int16, rgb [n, 3] float32, refl [n] float32. Ground rows use the
 * float64 coordinates, primitive rows the float32-rounded ones (as NumPy's surface() does). Returns 0, or
 * -1 for a primitive or material out of range. */
int pfs_surface(int64_t n, const double *points, const int32_t *prim, int64_t n_prim, const int32_t *kind,
                const float *prm, const float *yaw, const float *taper, const int32_t *material, const float *color,
                const float *reflectance, const double *road, int64_t n_lines, const double *lines,
                const float *ground_rgb, const float *ground_refl, float *normals, int16_t *mat, float *rgb,
                float *refl) {
    const Tables tabs = {n_prim, kind,    prm,     yaw,        taper,      color,      reflectance,
                         material, road, n_lines, lines, ground_rgb, ground_refl};
    int bad = 0;
    for (int64_t i = 0; i < n; i++) {
        const double *x = points + 3 * i;
        const float *c;
        int m = surface_point(x[0], x[1], (float)x[0], (float)x[1], (float)x[2], prim[i], &tabs, normals + 3 * i, &c,
                              refl + i);
        if (m < 0) {
            bad = 1;
            continue;
        }
        mat[i] = (int16_t)m;
        rgb[3 * i] = c[0];
        rgb[3 * i + 1] = c[1];
        rgb[3 * i + 2] = c[2];
    }
    return bad ? -1 : 0;
}
