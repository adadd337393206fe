/* The loss curve as an SVG picture (opens in any browser): training loss per
 * step, faint, with its moving average, and the validation loss as points. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <errno.h>
#include <fcntl.h>
#include <string.h>
#include <unistd.h>

#include "hypertrain/train.h"

typedef struct series {
    double *x, *y;
    int n, cap;
} series;

static void series_push(series *s, double x, double y) {
    if (s->n == s->cap) {
        s->cap = s->cap ? 2 * s->cap : 256;
        s->x = realloc(s->x, (size_t)s->cap * sizeof(double));
        s->y = realloc(s->y, (size_t)s->cap * sizeof(double));
    }
    s->x[s->n] = x;
    s->y[s->n] = y;
    s->n++;
}

/* A "nice" tick step (1, 2 or 5 times a power of ten) for about `count` ticks over span. */
static double nice_step(double span, int count) {
    double raw = span / count, mag = pow(10.0, floor(log10(raw))), f = raw / mag;
    return (f < 1.5 ? 1 : f < 3.5 ? 2 : f < 7.5 ? 5 : 10) * mag;
}

static ht_status read_metrics(const char *path, series *train, series *valid, ht_error *err) {
    char *text;
    size_t len;
    ht_status s = ht_read_file(path, &text, &len, err);
    if (s != HT_OK) return s;
    int lineno = 0;
    for (char *line = text; line && *line; lineno++) {
        char *end = strchr(line, '\n');
        size_t n = end ? (size_t)(end - line) : strlen(line);
        if (n > 0) {
            ht_json *obj;
            char what[1100];
            snprintf(what, sizeof(what), "%s line %d", path, lineno + 1);
            s = ht_json_parse(line, n, what, &obj, err);
            if (s != HT_OK) {
                free(text);
                return s;
            }
            const ht_json *step = ht_json_get(obj, "step"), *loss = ht_json_get(obj, "loss"),
                          *vl = ht_json_get(obj, "val_loss");
            if (step && step->type == HT_JSON_NUMBER) {
                if (loss && loss->type == HT_JSON_NUMBER) series_push(train, step->number, loss->number);
                if (vl && vl->type == HT_JSON_NUMBER) series_push(valid, step->number, vl->number);
            }
            ht_json_free(obj);
        }
        line = end ? end + 1 : NULL;
    }
    free(text);
    return HT_OK;
}

ht_status ht_plot_metrics(const char *metrics_path, const char *svg_path, ht_error *err) {
    series train = {0}, valid = {0};
    ht_status s = read_metrics(metrics_path, &train, &valid, err);
    if (s != HT_OK) goto done;
    if (train.n == 0 && valid.n == 0) {
        s = ht_fail(err, HT_ERR_FORMAT, "%s: no loss values to plot", metrics_path);
        goto done;
    }
    double x0 = INFINITY, x1 = -INFINITY, y0 = INFINITY, y1 = -INFINITY;
    series *all[2] = {&train, &valid};
    for (int k = 0; k < 2; k++)
        for (int i = 0; i < all[k]->n; i++) {
            x0 = fmin(x0, all[k]->x[i]);
            x1 = fmax(x1, all[k]->x[i]);
            if (isfinite(all[k]->y[i])) {
                y0 = fmin(y0, all[k]->y[i]);
                y1 = fmax(y1, all[k]->y[i]);
            }
        }
    if (x1 <= x0) x1 = x0 + 1;
    if (!(y1 > y0)) y1 = y0 + 1;
    double ypad = 0.05 * (y1 - y0);
    y0 -= ypad;
    y1 += ypad;
    const double W = 900, H = 520, L = 80, R = 30, Tm = 50, Bm = 60; /* canvas and margins */
    const double pw = W - L - R, ph = H - Tm - Bm;
#define PX(x) (L + ((x)-x0) / (x1 - x0) * pw)
#define PY(y) (Tm + (1.0 - ((y)-y0) / (y1 - y0)) * ph)
    /* Written beside, then renamed over the old picture: a kill or a full disk leaves the old one whole. */
    char tmp[4200];
    snprintf(tmp, sizeof(tmp), "%s.tmp", svg_path);
    int fd = open(tmp, O_WRONLY | O_CREAT | O_TRUNC | O_NOFOLLOW | O_CLOEXEC, 0644); /* never through a link */
    FILE *f = fd >= 0 ? fdopen(fd, "w") : NULL;
    if (!f && fd >= 0) close(fd);
    if (!f) {
        s = ht_fail(err, HT_ERR_IO, "%s: cannot open for writing: %s", tmp, strerror(errno));
        goto done;
    }
    fprintf(f,
            "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"%.0f\" height=\"%.0f\" "
            "font-family=\"sans-serif\" font-size=\"13\">\n",
            W, H);
    fprintf(f, "<rect width=\"100%%\" height=\"100%%\" fill=\"white\"/>\n");
    fprintf(f, "<text x=\"%.0f\" y=\"30\" font-size=\"18\" text-anchor=\"middle\">hypertrain: loss</text>\n", W / 2);
    double xs = nice_step(x1 - x0, 8), ys = nice_step(y1 - y0, 6);
    for (double v = ceil(y0 / ys) * ys; v <= y1; v += ys) {
        fprintf(f, "<line x1=\"%.1f\" y1=\"%.1f\" x2=\"%.1f\" y2=\"%.1f\" stroke=\"#e4e4e4\"/>\n", L, PY(v), L + pw,
                PY(v));
        fprintf(f, "<text x=\"%.1f\" y=\"%.1f\" text-anchor=\"end\">%g</text>\n", L - 8, PY(v) + 4, v);
    }
    for (double v = ceil(x0 / xs) * xs; v <= x1; v += xs) {
        fprintf(f, "<line x1=\"%.1f\" y1=\"%.1f\" x2=\"%.1f\" y2=\"%.1f\" stroke=\"#e4e4e4\"/>\n", PX(v), Tm, PX(v),
                Tm + ph);
        fprintf(f, "<text x=\"%.1f\" y=\"%.1f\" text-anchor=\"middle\">%g</text>\n", PX(v), Tm + ph + 20, v);
    }
    fprintf(f, "<rect x=\"%.0f\" y=\"%.0f\" width=\"%.0f\" height=\"%.0f\" fill=\"none\" stroke=\"#444\"/>\n", L, Tm,
            pw, ph);
    fprintf(f, "<text x=\"%.0f\" y=\"%.0f\" text-anchor=\"middle\">optimizer step</text>\n", L + pw / 2, H - 15);
    fprintf(f,
            "<text transform=\"translate(22 %.0f) rotate(-90)\" text-anchor=\"middle\">cross-entropy "
            "(nats/token)</text>\n",
            Tm + ph / 2);
    if (train.n > 0) {
        fprintf(f, "<polyline fill=\"none\" stroke=\"#9ecae1\" stroke-width=\"1\" points=\"");
        for (int i = 0; i < train.n; i++) fprintf(f, "%.1f,%.1f ", PX(train.x[i]), PY(train.y[i]));
        /* A centred moving average over about 1/30 of the run: it follows the trend without lagging it. */
        fprintf(f, "\"/>\n<polyline fill=\"none\" stroke=\"#08519c\" stroke-width=\"2.2\" points=\"");
        int half = train.n / 60;
        for (int i = 0; i < train.n; i++) {
            int a = i - half < 0 ? 0 : i - half, b = i + half >= train.n ? train.n - 1 : i + half;
            double sum = 0;
            for (int j = a; j <= b; j++) sum += train.y[j];
            fprintf(f, "%.1f,%.1f ", PX(train.x[i]), PY(sum / (b - a + 1)));
        }
        fprintf(f, "\"/>\n");
    }
    if (valid.n > 0) {
        fprintf(f, "<polyline fill=\"none\" stroke=\"#d94801\" stroke-width=\"2\" points=\"");
        for (int i = 0; i < valid.n; i++) fprintf(f, "%.1f,%.1f ", PX(valid.x[i]), PY(valid.y[i]));
        fprintf(f, "\"/>\n");
        for (int i = 0; i < valid.n; i++)
            fprintf(f, "<circle cx=\"%.1f\" cy=\"%.1f\" r=\"4\" fill=\"#d94801\"/>\n", PX(valid.x[i]), PY(valid.y[i]));
    }
    double lx = L + pw - 230, ly = Tm + 16;
    fprintf(f, "<rect x=\"%.0f\" y=\"%.0f\" width=\"220\" height=\"66\" fill=\"white\" stroke=\"#bbb\"/>\n", lx - 10,
            ly - 12);
    fprintf(f,
            "<line x1=\"%.0f\" y1=\"%.0f\" x2=\"%.0f\" y2=\"%.0f\" stroke=\"#9ecae1\"/>"
            "<text x=\"%.0f\" y=\"%.0f\">training loss (per step)</text>\n",
            lx, ly, lx + 24, ly, lx + 32, ly + 4);
    fprintf(f,
            "<line x1=\"%.0f\" y1=\"%.0f\" x2=\"%.0f\" y2=\"%.0f\" stroke=\"#08519c\" stroke-width=\"2.2\"/>"
            "<text x=\"%.0f\" y=\"%.0f\">training loss (smoothed)</text>\n",
            lx, ly + 20, lx + 24, ly + 20, lx + 32, ly + 24);
    fprintf(f,
            "<line x1=\"%.0f\" y1=\"%.0f\" x2=\"%.0f\" y2=\"%.0f\" stroke=\"#d94801\" stroke-width=\"2\"/>"
            "<text x=\"%.0f\" y=\"%.0f\">validation loss</text>\n",
            lx, ly + 40, lx + 24, ly + 40, lx + 32, ly + 44);
    fprintf(f, "</svg>\n");
#undef PX
#undef PY
    bool written = fflush(f) == 0 && !ferror(f);
    int e = errno;
    if (fclose(f) != 0 && written) written = false, e = errno;
    if (!written) {
        s = ht_fail(err, HT_ERR_IO, "%s: write failed: %s", tmp, strerror(e));
        unlink(tmp);
    } else if (rename(tmp, svg_path) != 0) {
        s = ht_fail(err, HT_ERR_IO, "%s: cannot rename %s into place: %s", svg_path, tmp, strerror(errno));
        unlink(tmp);
    }
done:
    free(train.x);
    free(train.y);
    free(valid.x);
    free(valid.y);
    return s;
}
