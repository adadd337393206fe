/* The run as one SVG picture (opens in any browser): the training loss per
 * step, faint, with its moving average, and the validation loss as points;
 * under it, on the same step axis, the learning rates (AdamW's on the left
 * axis, Muon's on the right), the gradient norm and the tokens a second. */
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

/* What the picture draws from metrics.jsonl, one series a key. */
enum { LOSS, VAL_LOSS, LR, MUON_LR, GRAD_NORM, TOKENS, N_SERIES };
static const char *const KEYS[N_SERIES] = {"loss", "val_loss", "lr", "muon_lr", "grad_norm", "tokens_per_s"};

/* A "nice" tick step (1, 2 or 5 times a power of ten) for about `count` ticks over span. */
static double nice_step(double span, int count) {
    double raw = span / count, mag = pow(10.0, floor(log10(raw))), f = raw / mag;
    return (f < 1.5 ? 1 : f < 3.5 ? 2 : f < 7.5 ? 5 : 10) * mag;
}

static ht_status read_metrics(const char *path, series *all, ht_error *err) {
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
            const ht_json *step = ht_json_get(obj, "step");
            for (int k = 0; k < N_SERIES && step && step->type == HT_JSON_NUMBER; k++) {
                const ht_json *v = ht_json_get(obj, KEYS[k]);
                if (v && v->type == HT_JSON_NUMBER) series_push(&all[k], step->number, v->number);
            }
            ht_json_free(obj);
        }
        line = end ? end + 1 : NULL;
    }
    free(text);
    return HT_OK;
}

/* A panel under the loss: the series on its left axis, and on its right (-1: none). */
typedef struct plot_row {
    int key, right;
    const char *label, *right_label;
} plot_row;

/* One panel: its box on the canvas and the ranges it maps, x shared by all. */
typedef struct panel {
    double left, top, width, height;
    double x0, x1, y0, y1;
} panel;

static double px(const panel *p, double x) { return p->left + (x - p->x0) / (p->x1 - p->x0) * p->width; }
static double py(const panel *p, double y) { return p->top + (1.0 - (y - p->y0) / (p->y1 - p->y0)) * p->height; }

/* The finite values' range of a series, 5% wider each way (a flat series: ±1, or ±5% of its value). */
static bool value_range(const series *s, double *lo, double *hi) {
    *lo = INFINITY, *hi = -INFINITY;
    for (int i = 0; i < s->n; i++)
        if (isfinite(s->y[i])) *lo = fmin(*lo, s->y[i]), *hi = fmax(*hi, s->y[i]);
    if (!(*hi >= *lo)) return false;
    if (!(*hi > *lo)) {
        const double d = *lo != 0 ? 0.05 * fabs(*lo) : 1.0;
        *lo -= d, *hi += d;
    }
    const double pad = 0.05 * (*hi - *lo);
    *lo -= pad, *hi += pad;
    return true;
}

/* The grid, the box and the step ticks (labelled on the bottom panel only). */
static void draw_frame(FILE *f, const panel *p, bool step_labels) {
    const double xs = nice_step(p->x1 - p->x0, 8);
    for (double v = ceil(p->x0 / xs) * xs; v <= p->x1; v += xs) {
        fprintf(f, "<line x1=\"%.1f\" y1=\"%.1f\" x2=\"%.1f\" y2=\"%.1f\" stroke=\"#e4e4e4\"/>\n", px(p, v), p->top,
                px(p, v), p->top + p->height);
        if (step_labels)
            fprintf(f, "<text x=\"%.1f\" y=\"%.1f\" text-anchor=\"middle\">%g</text>\n", px(p, v),
                    p->top + p->height + 20, v);
    }
    fprintf(f, "<rect x=\"%.0f\" y=\"%.0f\" width=\"%.0f\" height=\"%.0f\" fill=\"none\" stroke=\"#444\"/>\n", p->left,
            p->top, p->width, p->height);
}

/* The y ticks, their grid lines (left axis only) and the axis's label, in `color`, on the left or right. */
static void draw_y_axis(FILE *f, const panel *p, bool right, const char *label, const char *color) {
    const double ys = nice_step(p->y1 - p->y0, p->height > 200 ? 6 : 3);
    const double x = right ? p->left + p->width : p->left;
    for (double v = ceil(p->y0 / ys) * ys; v <= p->y1; v += ys) {
        if (fabs(v) < 1e-9 * ys) v = 0; /* no "-1.2e-17" */
        if (!right)
            fprintf(f, "<line x1=\"%.1f\" y1=\"%.1f\" x2=\"%.1f\" y2=\"%.1f\" stroke=\"#e4e4e4\"/>\n", p->left,
                    py(p, v), p->left + p->width, py(p, v));
        fprintf(f, "<text x=\"%.1f\" y=\"%.1f\" text-anchor=\"%s\" fill=\"%s\">%g</text>\n", right ? x + 8 : x - 8,
                py(p, v) + 4, right ? "start" : "end", color, v);
    }
    const double lx = right ? x + 72 : x - 70, ly = p->top + p->height / 2;
    fprintf(f, "<text transform=\"translate(%.0f %.0f) rotate(%d)\" text-anchor=\"middle\" fill=\"%s\">%s</text>\n", lx,
            ly, right ? 90 : -90, color, label);
}

static void draw_line(FILE *f, const panel *p, const series *s, const char *color, double width, bool dashed) {
    fprintf(f, "<polyline fill=\"none\" stroke=\"%s\" stroke-width=\"%g\"%s points=\"", color, width,
            dashed ? " stroke-dasharray=\"6 4\"" : "");
    for (int i = 0; i < s->n; i++)
        if (isfinite(s->y[i])) fprintf(f, "%.1f,%.1f ", px(p, s->x[i]), py(p, s->y[i]));
    fprintf(f, "\"/>\n");
}

/* Each step's value, faint, under a centred moving average over about 1/30
 * of the run, which follows the trend without lagging it. */
static void draw_smoothed(FILE *f, const panel *p, const series *s, const char *faint, const char *color) {
    draw_line(f, p, s, faint, 1, false);
    fprintf(f, "<polyline fill=\"none\" stroke=\"%s\" stroke-width=\"2.2\" points=\"", color);
    const int half = s->n / 60;
    for (int i = 0; i < s->n; i++) {
        int a = i - half < 0 ? 0 : i - half, b = i + half >= s->n ? s->n - 1 : i + half, count = 0;
        double sum = 0;
        for (int j = a; j <= b; j++)
            if (isfinite(s->y[j])) sum += s->y[j], count++;
        if (count > 0) fprintf(f, "%.1f,%.1f ", px(p, s->x[i]), py(p, sum / count));
    }
    fprintf(f, "\"/>\n");
}

/* The loss panel: the training loss smoothed over its steps, the
 * validation loss as points, a legend. */
static void draw_loss(FILE *f, const panel *p, const series *train, const series *valid) {
    draw_y_axis(f, p, false, "cross-entropy (nats/token)", "#000");
    if (train->n > 0) draw_smoothed(f, p, train, "#9ecae1", "#08519c");
    if (valid->n > 0) {
        draw_line(f, p, valid, "#d94801", 2, false);
        for (int i = 0; i < valid->n; i++)
            fprintf(f, "<circle cx=\"%.1f\" cy=\"%.1f\" r=\"4\" fill=\"#d94801\"/>\n", px(p, valid->x[i]),
                    py(p, valid->y[i]));
    }
    double lx = p->left + p->width - 230, ly = p->top + 16;
    fprintf(f, "<rect x=\"%.0f\" y=\"%.0f\" width=\"220\" height=\"66\" fill=\"white\" stroke=\"#bbb\"/>\n", lx - 10,
            ly - 12);
    const char *const names[] = {"training loss (per step)", "training loss (smoothed)", "validation loss"};
    const char *const colors[] = {"#9ecae1", "#08519c", "#d94801"};
    const double widths[] = {1, 2.2, 2};
    for (int i = 0; i < 3; i++)
        fprintf(f,
                "<line x1=\"%.0f\" y1=\"%.0f\" x2=\"%.0f\" y2=\"%.0f\" stroke=\"%s\" stroke-width=\"%g\"/>"
                "<text x=\"%.0f\" y=\"%.0f\">%s</text>\n",
                lx, ly + 20 * i, lx + 24, ly + 20 * i, colors[i], widths[i], lx + 32, ly + 20 * i + 4, names[i]);
}

ht_status ht_plot_metrics(const char *metrics_path, const char *svg_path, ht_error *err) {
    series all[N_SERIES] = {{0}};
    ht_status s = read_metrics(metrics_path, all, err);
    if (s != HT_OK) goto done;
    if (all[LOSS].n == 0 && all[VAL_LOSS].n == 0) {
        s = ht_fail(err, HT_ERR_FORMAT, "%s: no loss values to plot", metrics_path);
        goto done;
    }
    /* The step axis every panel shares. */
    double x0 = INFINITY, x1 = -INFINITY;
    for (int k = 0; k < N_SERIES; k++)
        for (int i = 0; i < all[k].n; i++) x0 = fmin(x0, all[k].x[i]), x1 = fmax(x1, all[k].x[i]);
    if (x1 <= x0) x1 = x0 + 1;
    /* The loss, then a panel for each of the others that has values. */
    plot_row rows[4] = {{LOSS, -1, NULL, NULL}};
    int n_rows = 1;
    double lo, hi;
    if (value_range(&all[LR], &lo, &hi) || value_range(&all[MUON_LR], &lo, &hi))
        rows[n_rows++] = (plot_row){LR, MUON_LR, "AdamW lr", "Muon lr"};
    if (value_range(&all[GRAD_NORM], &lo, &hi)) rows[n_rows++] = (plot_row){GRAD_NORM, -1, "gradient norm", NULL};
    if (value_range(&all[TOKENS], &lo, &hi)) rows[n_rows++] = (plot_row){TOKENS, -1, "tokens / s", NULL};
    const double W = 900, L = 90, R = 90, top = 50, loss_h = 330, small_h = 130, gap = 30, bottom = 60;
    const double H = top + loss_h + (n_rows - 1) * (gap + small_h) + bottom;
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
    fprintf(f, "<text x=\"%.0f\" y=\"30\" font-size=\"18\" text-anchor=\"middle\">hypertrain: loss%s</text>\n", W / 2,
            n_rows > 1 ? ", learning rate, gradient norm, throughput" : "");
    double y = top;
    for (int r = 0; r < n_rows; r++) {
        panel p = {L, y, W - L - R, r == 0 ? loss_h : small_h, x0, x1, 0, 1};
        const bool last = r == n_rows - 1;
        if (r == 0) {
            double vlo, vhi;
            bool any = value_range(&all[LOSS], &lo, &hi), vany = value_range(&all[VAL_LOSS], &vlo, &vhi);
            p.y0 = any && vany ? fmin(lo, vlo) : any ? lo : vlo;
            p.y1 = any && vany ? fmax(hi, vhi) : any ? hi : vhi;
            draw_frame(f, &p, last);
            draw_loss(f, &p, &all[LOSS], &all[VAL_LOSS]);
        } else {
            const series *left = &all[rows[r].key], *right = rows[r].right >= 0 ? &all[rows[r].right] : NULL;
            draw_frame(f, &p, last);
            if (value_range(left, &p.y0, &p.y1)) {
                draw_y_axis(f, &p, false, rows[r].label, right ? "#08519c" : "#000");
                if (right)
                    draw_line(f, &p, left, "#08519c", 2.2, false);
                else
                    draw_smoothed(f, &p, left, "#9ecae1", "#08519c");
            }
            panel q = p;
            if (right && value_range(right, &q.y0, &q.y1)) { /* dashed: the schedules often coincide */
                draw_y_axis(f, &q, true, rows[r].right_label, "#d94801");
                draw_line(f, &q, right, "#d94801", 1.6, true);
            }
        }
        y += p.height + gap;
    }
    fprintf(f, "<text x=\"%.0f\" y=\"%.0f\" text-anchor=\"middle\">optimizer step</text>\n", L + (W - L - R) / 2,
            H - 15);
    fprintf(f, "</svg>\n");
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
    for (int k = 0; k < N_SERIES; k++) {
        free(all[k].x);
        free(all[k].y);
    }
    return s;
}
