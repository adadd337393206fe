/* Values as YAML text, where each came from, and the logs: the "Trainer
 * config" table, one section's effective config, and the keys a Hugging Face
 * config.json overrides (ht_config_use_pretrained). */
#include "config/config_internal.h"

#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

ht_config_source ht_config_key_source(const ht_config *cfg, const char *key, int *line) {
    int i = ht_config_key_index(key);
    if (line) *line = i >= 0 ? cfg->line[i] : 0;
    return i >= 0 ? (ht_config_source)cfg->source[i] : HT_CONFIG_SOURCE_DEFAULT;
}

const char *ht_config_source_name(ht_config_source source) {
    switch (source) {
    case HT_CONFIG_SOURCE_DEFAULT: return "default";
    case HT_CONFIG_SOURCE_FILE: return "file";
    case HT_CONFIG_SOURCE_CLI: return "command line";
    case HT_CONFIG_SOURCE_PRETRAINED: return "model.from_pretrained's config.json";
    }
    return "?";
}

/* Appends with truncation; `used` never passes n - 1. */
static void put(char *buf, size_t n, size_t *used, const char *fmt, ...) __attribute__((format(printf, 4, 5)));
static void put(char *buf, size_t n, size_t *used, const char *fmt, ...) {
    if (*used + 1 >= n) return;
    va_list ap;
    va_start(ap, fmt);
    int w = vsnprintf(buf + *used, n - *used, fmt, ap);
    va_end(ap);
    if (w > 0) *used += (size_t)w < n - *used ? (size_t)w : n - *used - 1;
}

/* Shortest text that reads back as the same double. */
static void put_double(char *buf, size_t n, size_t *used, double x) {
    char tmp[48];
    int prec = 1;
    for (; prec <= 17; prec++) {
        snprintf(tmp, sizeof(tmp), "%.*g", prec, x);
        if (strtod(tmp, NULL) == x) break;
    }
    /* Positional, not exponent, notation in Python's repr range: 500000.0, not 5e+05. */
    double ax = fabs(x);
    if (strchr(tmp, 'e') && ax >= 1e-4 && ax < 1e16) {
        int decimals = prec - 1 - (int)floor(log10(ax));
        snprintf(tmp, sizeof(tmp), "%.*f", decimals > 0 ? decimals : 0, x);
    }
    /* Keep it a YAML 1.1 float (PyYAML wants the dot): 10000 -> 10000.0, 1e-06 -> 1.0e-06. */
    char *e = strchr(tmp, 'e');
    if (e && !memchr(tmp, '.', (size_t)(e - tmp))) {
        memmove(e + 2, e, strlen(e) + 1);
        memcpy(e, ".0", 2);
    } else if (!strpbrk(tmp, ".en")) {
        strcat(tmp, ".0");
    }
    put(buf, n, used, "%s", tmp);
}

/* A double-quoted YAML string, escaped. */
static void put_quoted(char *buf, size_t n, size_t *used, const char *s) {
    put(buf, n, used, "\"");
    for (; *s; s++) {
        if (*s == '"' || *s == '\\')
            put(buf, n, used, "\\%c", *s);
        else if (*s == '\n' || *s == '\t')
            put(buf, n, used, "\\%c", *s == '\n' ? 'n' : 't');
        else
            put(buf, n, used, "%c", *s);
    }
    put(buf, n, used, "\"");
}

/* A string as a YAML scalar: plain when it reads back as the same string, else double-quoted. */
static void put_string(char *buf, size_t n, size_t *used, const char *s) {
    bool plain = *s && !strchr(" \t-?:,[]{}#&*!|>'\"%@`~", s[0]) && s[strlen(s) - 1] != ' ' && !strstr(s, ": ") &&
                 !strstr(s, " #") && !strpbrk(s, "\n\t\r");
    if (plain) {
        yaml_node_t fake = {0};
        fake.type = YAML_SCALAR_NODE;
        fake.data.scalar.value = (yaml_char_t *)s;
        fake.data.scalar.style = YAML_PLAIN_SCALAR_STYLE;
        long long iv;
        double dv;
        bool bv;
        plain = ht_config_classify(&fake, &iv, &dv, &bv) == SC_STR;
    }
    if (plain)
        put(buf, n, used, "%s", s);
    else
        put_quoted(buf, n, used, s);
}

static void put_triple(char *buf, size_t n, size_t *used, const double abc[3]) {
    put(buf, n, used, "[");
    for (int j = 0; j < 3; j++) {
        if (j) put(buf, n, used, ", ");
        put_double(buf, n, used, abc[j]);
    }
    put(buf, n, used, "]");
}

static void format_value(const ht_config *cfg, int i, char *buf, size_t n) {
    const key_desc *k = &ht_config_keys[i];
    const void *src = (const char *)cfg + k->offset;
    size_t used = 0;
    buf[0] = '\0';
    switch (k->type) {
    case KT_INT:
        if ((k->flags & NULLABLE) && *(const int *)src == 0)
            put(buf, n, &used, "null");
        else
            put(buf, n, &used, "%d", *(const int *)src);
        break;
    case KT_I64: put(buf, n, &used, "%lld", (long long)*(const int64_t *)src); break;
    case KT_FLOAT: put_double(buf, n, &used, *(const double *)src); break;
    case KT_BOOL: put(buf, n, &used, "%s", *(const bool *)src ? "true" : "false"); break;
    case KT_STR:
        if ((k->flags & NULLABLE) && !*(const char *)src)
            put(buf, n, &used, "null");
        else
            put_string(buf, n, &used, src);
        break;
    case KT_ENUM: {
        int v;
        memcpy(&v, src, sizeof(v));
        const char *name = "?";
        for (const enum_name *e = k->names; e->name; e++)
            if (e->value == v) {
                name = e->name;
                break;
            }
        put(buf, n, &used, "%s", name);
        break;
    }
    case KT_DTYPE: {
        ht_dtype dt;
        memcpy(&dt, src, sizeof(dt));
        put(buf, n, &used, "%s", dt == HT_CONFIG_DTYPE_NONE ? "null" : ht_dtype_name(dt));
        break;
    }
    case KT_STRS: {
        const ht_config_strings *list = src;
        put(buf, n, &used, "[");
        for (int j = 0; j < list->count; j++) {
            if (j) put(buf, n, &used, ", ");
            put_quoted(buf, n, &used, list->items[j]);
        }
        put(buf, n, &used, "]");
        break;
    }
    case KT_FLOATS:
        put(buf, n, &used, "[");
        for (size_t j = 0; j < k->size / sizeof(double); j++) {
            if (j) put(buf, n, &used, ", ");
            put_double(buf, n, &used, ((const double *)src)[j]);
        }
        put(buf, n, &used, "]");
        break;
    case KT_LAYERS: {
        const ht_layer_list *list = src;
        put(buf, n, &used, "[");
        for (int j = 0; j < list->count; j++) put(buf, n, &used, "%s%d", j ? ", " : "", list->items[j]);
        put(buf, n, &used, "]");
        break;
    }
    case KT_NS: {
        const ht_config_ns_coefficients *ns = src;
        if (ns->count == 0) {
            put(buf, n, &used, "null");
        } else if (ns->count == 1 && ns->repeat[0] == 0) {
            put_triple(buf, n, &used, ns->abc[0]);
        } else {
            put(buf, n, &used, "[");
            for (int j = 0; j < ns->count; j++) {
                if (j) put(buf, n, &used, ", ");
                if (ns->repeat[j] != 1) put(buf, n, &used, "[");
                put_triple(buf, n, &used, ns->abc[j]);
                if (ns->repeat[j] != 1) put(buf, n, &used, ", %d]", ns->repeat[j]);
            }
            put(buf, n, &used, "]");
        }
        break;
    }
    case KT_SHARD:
        if (*(const int *)src == 0)
            put(buf, n, &used, "auto");
        else
            put(buf, n, &used, "%d", *(const int *)src);
        break;
    case KT_AUTO_INT:
        if (*(const int *)src < 0)
            put(buf, n, &used, "auto");
        else
            put(buf, n, &used, "%d", *(const int *)src);
        break;
    case KT_SWITCH_PATH: {
        const ht_config_switch_path *sp = src;
        if (sp->on && sp->path[0])
            put_quoted(buf, n, &used, sp->path);
        else
            put(buf, n, &used, "%s", sp->on ? "true" : "false");
        break;
    }
    case KT_STEPS: {
        const ht_config_steps *st = src;
        if (!st->on || st->count == 0) {
            put(buf, n, &used, "%s", st->on ? "true" : "false");
            break;
        }
        put(buf, n, &used, "[");
        for (int j = 0; j < st->count; j++) put(buf, n, &used, "%s%lld", j ? ", " : "", (long long)st->items[j]);
        put(buf, n, &used, "]");
        break;
    }
    case KT_REJECT: put(buf, n, &used, "null"); break;
    }
}

bool ht_config_format_value(const ht_config *cfg, const char *key, char *buf, size_t n) {
    int i = ht_config_key_index(key);
    if (i < 0 || n == 0) return false;
    format_value(cfg, i, buf, n);
    return true;
}

/* "MindFormers'", "HyperParallel's". */
static const char *dialect_possessive(ht_config_dialect d) {
    switch (d) {
    case HT_CONFIG_DIALECT_HYPERTRAIN: return "hypertrain's";
    case HT_CONFIG_DIALECT_HYPERPARALLEL: return "HyperParallel's";
    case HT_CONFIG_DIALECT_MINDFORMERS: return "MindFormers'";
    case HT_CONFIG_DIALECT_MINDSPEED: return "MindSpeed-MM's";
    }
    return "?";
}

/* "file, line 12", "command line", "default"; ", as <alias>" when an alias set it. */
static void describe_source(const ht_config *cfg, int i, char *buf, size_t n) {
    const char *as = cfg->alias[i] ? ht_config_aliases[cfg->alias[i] - 1].alias : NULL;
    if (cfg->source[i] == HT_CONFIG_SOURCE_DEFAULT && cfg->dialect_default[i])
        snprintf(buf, n, "%s default", dialect_possessive(cfg->dialect));
    else if (cfg->source[i] == HT_CONFIG_SOURCE_PRETRAINED)
        snprintf(buf, n, "config.json of %s", cfg->model.from_pretrained);
    else if (cfg->source[i] == HT_CONFIG_SOURCE_FILE && cfg->line[i] > 0)
        snprintf(buf, n, "file, line %d%s%s", cfg->line[i], as ? ", as " : "", as ? as : "");
    else
        snprintf(buf, n, "%s%s%s", ht_config_source_name((ht_config_source)cfg->source[i]), as ? ", as " : "",
                 as ? as : "");
}

void ht_config_use_pretrained(ht_config *cfg, const ht_model_config *arch) {
    const size_t first = offsetof(ht_config, model.arch), end = first + sizeof(ht_model_config);
    const size_t lora = offsetof(ht_config, model.arch.lora), lora_end = lora + sizeof(ht_lora_config);
    char before[1024], now[1024], where[HT_CONFIG_STR_MAX + 64];
    for (int i = 0; i < ht_config_n_keys; i++) {
        const key_desc *k = &ht_config_keys[i];
        if (k->type == KT_REJECT || k->offset < first || k->offset >= end ||
            (k->offset >= lora && k->offset < lora_end))
            continue;
        format_value(cfg, i, before, sizeof(before));
        describe_source(cfg, i, where, sizeof(where));
        memcpy((char *)cfg + k->offset, (const char *)arch + (k->offset - first), k->size);
        format_value(cfg, i, now, sizeof(now));
        if (cfg->source[i] != HT_CONFIG_SOURCE_DEFAULT && strcmp(before, now) != 0)
            ht_log_warn_once("%s: %s (%s) is not used: the model is %s/config.json's, which says %s",
                             ht_config_key_spelling(cfg, k->path), before, where, cfg->model.from_pretrained, now);
        cfg->source[i] = HT_CONFIG_SOURCE_PRETRAINED;
        cfg->line[i] = 0;
        cfg->alias[i] = 0;
        cfg->dialect_default[i] = 0;
    }
    ht_lora_config keep = cfg->model.arch.lora; /* never in config.json */
    cfg->model.arch = *arch;
    cfg->model.arch.lora = keep;
}

void ht_config_log(const ht_config *cfg) {
    int key_w = 3, val_w = 5;
    char value[1024];
    for (int i = 0; i < ht_config_n_keys; i++) {
        if (ht_config_keys[i].type == KT_REJECT) continue;
        int kl = (int)strlen(ht_config_keys[i].path);
        if (kl > key_w) key_w = kl;
        format_value(cfg, i, value, sizeof(value));
        int vl = (int)strlen(value);
        if (vl > val_w && vl <= 40) val_w = vl;
    }
    ht_log_info("Trainer config%s%s (%s dialect)", cfg->file[0] ? " from " : "", cfg->file,
                dialect_possessive(cfg->dialect));
    ht_log_info("  %-*s  %-*s  %s", key_w, "key", val_w, "value", "source");
    for (int i = 0; i < ht_config_n_keys; i++) {
        if (ht_config_keys[i].type == KT_REJECT) continue;
        format_value(cfg, i, value, sizeof(value));
        char source[HT_CONFIG_STR_MAX + 64];
        describe_source(cfg, i, source, sizeof(source));
        ht_log_info("  %-*s  %-*s  %s", key_w, ht_config_keys[i].path, val_w, value, source);
    }
    for (int j = 0; j < cfg->ignored_count; j++) {
        char hint[256];
        bool close = ht_config_suggest(cfg->ignored[j], hint, sizeof(hint)) != NULL;
        ht_log_warn_once("%s:%d: %s is not a key hypertrain uses; ignored (%s allows extra keys in this section)%s%s%s",
                         cfg->file, cfg->ignored_line[j], cfg->ignored[j], ht_config_dialect_name(cfg->dialect),
                         close ? "; did you mean " : "", close ? hint : "", close ? "?" : "");
    }
}

void ht_config_log_section(const ht_config *cfg, const char *title, const char *prefix) {
    size_t plen = strlen(prefix);
    int key_w = 3, def_w = 7, conf_w = 10;
    char value[1024], conf[2 * HT_CONFIG_STR_MAX + 96], source[HT_CONFIG_STR_MAX + 64];
    for (int pass = 0; pass < 2; pass++) {
        if (pass == 1) {
            ht_log_info("Effective %s config", title);
            ht_log_info("  %-*s  %-*s  %-*s  %s", key_w, "key", def_w, "default", conf_w, "configured", "final");
        }
        for (int i = 0; i < ht_config_n_keys; i++) {
            if (ht_config_keys[i].type == KT_REJECT || strncmp(ht_config_keys[i].path, prefix, plen) != 0) continue;
            const char *name = ht_config_keys[i].path[plen] ? ht_config_keys[i].path + plen : ht_config_keys[i].path;
            format_value(cfg, i, value, sizeof(value));
            if (cfg->source[i] == HT_CONFIG_SOURCE_DEFAULT) {
                snprintf(conf, sizeof(conf), "-");
            } else {
                describe_source(cfg, i, source, sizeof(source));
                snprintf(conf, sizeof(conf), "%s (%s)", value, source);
            }
            if (pass == 0) {
                int kl = (int)strlen(name), dl = (int)strlen(ht_config_keys[i].def), cl = (int)strlen(conf);
                if (kl > key_w) key_w = kl;
                if (dl > def_w && dl <= 40) def_w = dl;
                if (cl > conf_w && cl <= 60) conf_w = cl;
                continue;
            }
            ht_log_info("  %-*s  %-*s  %-*s  %s", key_w, name, def_w, ht_config_keys[i].def, conf_w, conf, value);
        }
    }
}
