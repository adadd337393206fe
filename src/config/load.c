/* Reading YAML into a config: a scalar's type by the core schema, a node's
 * value for a key's type, a file (libyaml's document API, for line numbers)
 * under size and nesting caps, --set overrides, and ht_config_load. */
#include "config/config_internal.h"

#include <errno.h>
#include <limits.h>
#include <math.h>
#include <pwd.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

/* ---------------------------------------------------------------- messages */

static void origin_prefix(const origin *o, int line, char *buf, size_t n) {
    if (o->set_arg)
        snprintf(buf, n, "--set %s: ", o->set_arg);
    else if (o->file && line > 0)
        snprintf(buf, n, "%s:%d: ", o->file, line);
    else if (o->file)
        snprintf(buf, n, "%s: ", o->file);
    else
        snprintf(buf, n, "default: ");
}

static int node_line(const yaml_node_t *node) { return (int)node->start_mark.line + 1; }

static bool all_digits(const char *s) {
    if (!*s) return false;
    for (; *s; s++)
        if (*s < '0' || *s > '9') return false;
    return true;
}

/* YAML core-schema resolution of a scalar (quoted scalars are always strings;
 * of the YAML 1.1 booleans only true/false count, so `yes` stays a string). */
scalar_kind ht_config_classify(const yaml_node_t *node, long long *iv, double *dv, bool *bv) {
    const char *s = scalar_text(node);
    if (node->data.scalar.style != YAML_PLAIN_SCALAR_STYLE) return SC_STR;
    if (!*s || !strcmp(s, "~") || !strcmp(s, "null") || !strcmp(s, "Null") || !strcmp(s, "NULL")) return SC_NULL;
    if (!strcmp(s, "true") || !strcmp(s, "True") || !strcmp(s, "TRUE")) return *bv = true, SC_BOOL;
    if (!strcmp(s, "false") || !strcmp(s, "False") || !strcmp(s, "FALSE")) return *bv = false, SC_BOOL;
    const char *body = (*s == '-' || *s == '+') ? s + 1 : s;
    if (all_digits(body)) {
        errno = 0;
        *iv = strtoll(s, NULL, 10);
        *dv = strtod(s, NULL);
        return errno == ERANGE ? SC_FLOAT : SC_INT;
    }
    if (!strcmp(body, ".inf") || !strcmp(body, ".Inf") || !strcmp(body, ".INF")) {
        *dv = *s == '-' ? -INFINITY : INFINITY;
        return SC_FLOAT;
    }
    if (!strcmp(s, ".nan") || !strcmp(s, ".NaN") || !strcmp(s, ".NAN")) return *dv = NAN, SC_FLOAT;
    bool digit = false;
    for (const char *p = body; *p; p++) {
        if (*p >= '0' && *p <= '9')
            digit = true;
        else if (!strchr(".eE+-", *p))
            return SC_STR;
    }
    if (!digit) return SC_STR;
    char *end;
    *dv = strtod(s, &end);
    return *end == '\0' ? SC_FLOAT : SC_STR;
}

/* What a node is, for "found ...": `1.5 (a float)`, `"ten" (a string)`, `a sequence`. */
static void describe(const yaml_node_t *node, char *buf, size_t n) {
    if (node->type == YAML_MAPPING_NODE) {
        snprintf(buf, n, "a mapping");
        return;
    }
    if (node->type == YAML_SEQUENCE_NODE) {
        snprintf(buf, n, "a sequence");
        return;
    }
    long long iv;
    double dv;
    bool bv;
    const char *s = scalar_text(node);
    int w = strlen(s) > 80 ? 77 : 80;
    const char *dots = strlen(s) > 80 ? "..." : "";
    switch (ht_config_classify(node, &iv, &dv, &bv)) {
    case SC_NULL: snprintf(buf, n, "null"); break;
    case SC_BOOL: snprintf(buf, n, "%s (a bool)", s); break;
    case SC_INT: snprintf(buf, n, "%s (an integer)", s); break;
    case SC_FLOAT: snprintf(buf, n, "%s (a float)", s); break;
    case SC_STR: snprintf(buf, n, "\"%.*s%s\" (a string)", w, s, dots); break;
    }
}

static void expected_enum(const enum_name *names, char *buf, size_t n) {
    size_t used = (size_t)snprintf(buf, n, "one of");
    const char *sep = " ";
    for (const enum_name *e = names; e->name && used < n; e++) {
        if (e->hidden) continue;
        used += (size_t)snprintf(buf + used, n - used, "%s%s", sep, e->name);
        sep = ", ";
    }
}

static void expected(const key_desc *k, char *buf, size_t n) {
    const char *or_null = (k->flags & NULLABLE) ? " or null" : "";
    switch (k->type) {
    case KT_INT:
    case KT_I64: snprintf(buf, n, "an integer%s", or_null); break;
    case KT_FLOAT: snprintf(buf, n, "a finite number"); break;
    case KT_BOOL: snprintf(buf, n, "true or false"); break;
    case KT_STR: snprintf(buf, n, "a string of at most %zu bytes%s", k->size - 1, or_null); break;
    case KT_ENUM: expected_enum(k->names, buf, n); break;
    case KT_DTYPE:
        snprintf(buf, n, "one of float16, bfloat16, float32%s", (k->flags & NULLABLE) ? ", null" : "");
        break;
    case KT_STRS:
        snprintf(buf, n, "a list of at most %d strings of at most %d bytes", HT_CONFIG_LIST_MAX, HT_CONFIG_STR_MAX - 1);
        break;
    case KT_FLOATS: snprintf(buf, n, "a list of %zu numbers", k->size / sizeof(double)); break;
    case KT_LAYERS: snprintf(buf, n, "a list of at most %d layer indices (integers >= 0)", HT_LAYER_LIST_MAX); break;
    case KT_NS:
        snprintf(buf, n, "null, [a, b, c], [[a, b, c], ...] or [[[a, b, c], count], ...] (at most %d entries)",
                 HT_CONFIG_NS_MAX);
        break;
    case KT_SHARD: snprintf(buf, n, "auto or a positive integer"); break;
    case KT_AUTO_INT: snprintf(buf, n, "auto or an integer >= 0"); break;
    case KT_SWITCH_PATH: snprintf(buf, n, "true, false or a directory"); break;
    case KT_STEPS:
        snprintf(buf, n, "true, false or a list of at most %d steps (integers >= 1)", HT_CONFIG_STEPS_MAX);
        break;
    case KT_REJECT: snprintf(buf, n, "nothing: %s", k->names[0].name); break;
    }
}

/* `why`: what is wrong with a value of the right form ("" when the form is wrong). */
static ht_status type_error(const key_desc *k, const origin *o, int line, const yaml_node_t *node, const char *why,
                            ht_error *err) {
    char where[HT_CONFIG_STR_MAX + 64], want[512], found[160];
    origin_prefix(o, line, where, sizeof(where));
    expected(k, want, sizeof(want));
    describe(node, found, sizeof(found));
    if (k->type == KT_REJECT) return ht_fail(err, HT_ERR_CONFIG, "%s%s: %s", where, k->path, k->names[0].name);
    if (why && why[0]) return ht_fail(err, HT_ERR_CONFIG, "%s%s: %s", where, k->path, why);
    return ht_fail(err, HT_ERR_CONFIG, "%s%s: expected %s, found %s", where, k->path, want, found);
}

/* ---------------------------------------------------------------- values */

static bool node_number(const yaml_node_t *node, double *out) {
    long long iv;
    double dv;
    bool bv;
    if (node->type != YAML_SCALAR_NODE) return false;
    scalar_kind kind = ht_config_classify(node, &iv, &dv, &bv);
    if (kind != SC_INT && kind != SC_FLOAT) return false;
    *out = dv;
    return isfinite(dv);
}

static bool node_int(const yaml_node_t *node, long long lo, long long hi, long long *out) {
    long long iv;
    double dv;
    bool bv;
    if (node->type != YAML_SCALAR_NODE || ht_config_classify(node, &iv, &dv, &bv) != SC_INT) return false;
    if (iv < lo || iv > hi) return false;
    *out = iv;
    return true;
}

static bool node_string(const yaml_node_t *node, char *dst, size_t size) {
    long long iv;
    double dv;
    bool bv;
    if (node->type != YAML_SCALAR_NODE || ht_config_classify(node, &iv, &dv, &bv) == SC_NULL) return false;
    if (node->data.scalar.length >= size) return false;
    if (strlen(scalar_text(node)) != node->data.scalar.length) return false; /* a "\0" escape: never cut short */
    memcpy(dst, scalar_text(node), node->data.scalar.length + 1);
    return true;
}

/* A path key's value as a shell would take it: a leading ~ or ~/ is $HOME
 * (the password file's home where HOME is unset), ~user/ that user's home.
 * A $NAME or ${NAME} is refused rather than kept: YAML expands no
 * variables, and a directory literally named "$HOME" is never meant. */
static bool expand_path(char *path, size_t size, char *why, size_t why_size) {
    for (const char *d = strchr(path, '$'); d; d = strchr(d + 1, '$'))
        if (d[1] == '{' || d[1] == '_' || (d[1] >= 'A' && d[1] <= 'Z') || (d[1] >= 'a' && d[1] <= 'z')) {
            snprintf(why, why_size,
                     "%s names an environment variable, which a configuration file does not expand; write the path "
                     "itself (a leading ~ is expanded)",
                     path);
            return false;
        }
    if (path[0] != '~') return true;
    size_t user_len = strcspn(path + 1, "/");
    const char *home = NULL;
    char user[256];
    if (user_len >= sizeof(user)) user_len = sizeof(user) - 1;
    memcpy(user, path + 1, user_len);
    user[user_len] = '\0';
    struct passwd *pw = user_len ? getpwnam(user) : NULL;
    if (user_len == 0) home = getenv("HOME");
    if (user_len == 0 && (!home || !home[0])) pw = getpwuid(getuid());
    if (!home || !home[0]) home = pw ? pw->pw_dir : NULL;
    if (!home) {
        snprintf(why, why_size, "%s: %s, so its ~ cannot be expanded", path,
                 user_len ? "no such user" : "HOME is not set and this user has no home directory");
        return false;
    }
    char expanded[HT_CONFIG_STR_MAX];
    int n = snprintf(expanded, sizeof(expanded), "%s%s", home, path + 1 + user_len);
    if (n < 0 || (size_t)n >= size || (size_t)n >= sizeof(expanded)) {
        snprintf(why, why_size, "%s: expanded to %s%s, longer than %zu bytes", path, home, path + 1 + user_len,
                 size - 1);
        return false;
    }
    memcpy(path, expanded, (size_t)n + 1);
    return true;
}

static bool node_is_null(const yaml_node_t *node) {
    long long iv;
    double dv;
    bool bv;
    return node->type == YAML_SCALAR_NODE && ht_config_classify(node, &iv, &dv, &bv) == SC_NULL;
}

static int seq_len(const yaml_node_t *node) {
    return (int)(node->data.sequence.items.top - node->data.sequence.items.start);
}

static yaml_node_t *seq_item(yaml_document_t *doc, const yaml_node_t *node, int i) {
    return yaml_document_get_node(doc, node->data.sequence.items.start[i]);
}

/* A sequence of exactly 3 finite numbers. */
static bool node_triple(yaml_document_t *doc, const yaml_node_t *node, double abc[3]) {
    if (node->type != YAML_SEQUENCE_NODE || seq_len(node) != 3) return false;
    for (int i = 0; i < 3; i++)
        if (!node_number(seq_item(doc, node, i), &abc[i])) return false;
    return true;
}

/* A Newton-Schulz schedule: null, [a, b, c], [[a, b, c], ...] or
 * [[[a, b, c], n], ...]. When the form is right but a value is not, `why`
 * says which (a non-finite coefficient, a count out of range). */
static bool node_ns(yaml_document_t *doc, const yaml_node_t *node, ht_config_ns_coefficients *ns, char *why,
                    size_t why_size) {
    memset(ns, 0, sizeof(*ns));
    if (node_is_null(node)) return true;
    if (node_triple(doc, node, ns->abc[0])) {
        ns->count = 1;
        ns->repeat[0] = 0;
        return true;
    }
    if (node->type != YAML_SEQUENCE_NODE || seq_len(node) == 0) return false;
    if (seq_len(node) > HT_CONFIG_NS_MAX) {
        snprintf(why, why_size, "%d segments; at most %d", seq_len(node), HT_CONFIG_NS_MAX);
        return false;
    }
    for (int i = 0; i < seq_len(node); i++) {
        yaml_node_t *item = seq_item(doc, node, i);
        long long count;
        bool pair = item->type == YAML_SEQUENCE_NODE && seq_len(item) == 2;
        yaml_node_t *abc = pair ? seq_item(doc, item, 0) : item;
        if (abc->type == YAML_SEQUENCE_NODE && seq_len(abc) == 3 && !node_triple(doc, abc, ns->abc[i])) {
            snprintf(why, why_size, "segment %d: every coefficient must be a finite number", i);
            return false;
        }
        if (!pair && node_triple(doc, item, ns->abc[i])) {
            ns->repeat[i] = 1;
        } else if (pair && node_triple(doc, abc, ns->abc[i])) {
            yaml_node_t *n = seq_item(doc, item, 1);
            if (!node_int(n, LLONG_MIN, LLONG_MAX, &count)) return false;
            if (count < 1 || count > HT_CONFIG_NS_MAX_REPEAT) {
                snprintf(why, why_size, "segment %d repeats %lld times; expected 1 to %d", i, count,
                         HT_CONFIG_NS_MAX_REPEAT);
                return false;
            }
            ns->repeat[i] = (int)count;
        } else {
            return false;
        }
    }
    ns->count = seq_len(node);
    return true;
}

/* Converts `node` to key k's type into dst (k->size bytes); false on a type mismatch. */
static bool convert(const key_desc *k, yaml_document_t *doc, const yaml_node_t *node, void *dst, char *why,
                    size_t why_size) {
    why[0] = '\0';
    long long iv;
    double dv;
    bool bv;
    switch (k->type) {
    case KT_INT:
        if ((k->flags & NULLABLE) &&
            node_is_null(node)) { /* null: not given, which the key's reader says how to fill */
            *(int *)dst = 0;
            return true;
        }
        if (!node_int(node, INT_MIN, INT_MAX, &iv)) return false;
        *(int *)dst = (int)iv;
        return true;
    case KT_I64:
        if (!node_int(node, INT64_MIN, INT64_MAX, &iv)) return false;
        *(int64_t *)dst = (int64_t)iv;
        return true;
    case KT_FLOAT: return node_number(node, (double *)dst);
    case KT_BOOL:
        if (node->type != YAML_SCALAR_NODE || ht_config_classify(node, &iv, &dv, &bv) != SC_BOOL) return false;
        *(bool *)dst = bv;
        return true;
    case KT_STR:
        if ((k->flags & NULLABLE) && node_is_null(node)) {
            ((char *)dst)[0] = '\0';
            return true;
        }
        if (!node_string(node, dst, k->size)) return false;
        return !(k->flags & FS_PATH) || expand_path(dst, k->size, why, why_size);
    case KT_ENUM:
        if (node->type != YAML_SCALAR_NODE) return false;
        for (const enum_name *e = k->names; e->name; e++) {
            if (strcmp(e->name, scalar_text(node)) == 0) {
                memcpy(dst, &e->value, sizeof(int));
                return true;
            }
        }
        return false;
    case KT_DTYPE: {
        ht_dtype dt;
        if ((k->flags & NULLABLE) && node_is_null(node)) {
            dt = HT_CONFIG_DTYPE_NONE;
        } else {
            /* MindSpeed-MM spells them short. */
            static const struct {
                const char *name;
                ht_dtype dtype;
            } short_names[] = {{"bf16", HT_DTYPE_BF16}, {"fp16", HT_DTYPE_F16}, {"fp32", HT_DTYPE_F32}};
            bool known = false;
            for (size_t s = 0; node->type == YAML_SCALAR_NODE && s < sizeof(short_names) / sizeof(short_names[0]); s++)
                if (strcmp(scalar_text(node), short_names[s].name) == 0) {
                    dt = short_names[s].dtype;
                    known = true;
                }
            if (!known && (node->type != YAML_SCALAR_NODE || !ht_dtype_from_name(scalar_text(node), &dt))) return false;
            if (dt != HT_DTYPE_F32 && dt != HT_DTYPE_BF16 && dt != HT_DTYPE_F16) return false;
        }
        memcpy(dst, &dt, sizeof(dt));
        return true;
    }
    case KT_STRS: {
        ht_config_strings *list = dst;
        list->count = 0;
        if (node_is_null(node)) return true;
        if (node->type != YAML_SEQUENCE_NODE || seq_len(node) > HT_CONFIG_LIST_MAX) return false;
        for (int i = 0; i < seq_len(node); i++)
            if (!node_string(seq_item(doc, node, i), list->items[i], HT_CONFIG_STR_MAX) ||
                ((k->flags & FS_PATH) && !expand_path(list->items[i], HT_CONFIG_STR_MAX, why, why_size)))
                return false;
        list->count = seq_len(node);
        return true;
    }
    case KT_FLOATS: {
        int n = (int)(k->size / sizeof(double));
        if (node->type != YAML_SEQUENCE_NODE || seq_len(node) != n) return false;
        for (int i = 0; i < n; i++)
            if (!node_number(seq_item(doc, node, i), (double *)dst + i)) return false;
        return true;
    }
    case KT_LAYERS: {
        ht_layer_list *list = dst;
        list->count = 0;
        if (node_is_null(node)) return true;
        if (node->type != YAML_SEQUENCE_NODE || seq_len(node) > HT_LAYER_LIST_MAX) return false;
        for (int i = 0; i < seq_len(node); i++) {
            if (!node_int(seq_item(doc, node, i), 0, INT_MAX, &iv)) return false;
            list->items[i] = (int)iv;
        }
        list->count = seq_len(node);
        return true;
    }
    case KT_NS: return node_ns(doc, node, dst, why, why_size);
    case KT_SHARD:
        if (node->type == YAML_SCALAR_NODE && strcmp(scalar_text(node), "auto") == 0) {
            *(int *)dst = 0;
            return true;
        }
        if (!node_int(node, 1, INT_MAX, &iv)) return false;
        *(int *)dst = (int)iv;
        return true;
    case KT_AUTO_INT:
        if (node->type == YAML_SCALAR_NODE && strcmp(scalar_text(node), "auto") == 0) {
            *(int *)dst = -1;
            return true;
        }
        if (!node_int(node, 0, INT_MAX, &iv)) return false;
        *(int *)dst = (int)iv;
        return true;
    case KT_SWITCH_PATH: {
        ht_config_switch_path *sp = dst;
        memset(sp, 0, sizeof(*sp));
        if (node_is_null(node)) return true;
        if (node->type == YAML_SCALAR_NODE && ht_config_classify(node, &iv, &dv, &bv) == SC_BOOL) {
            sp->on = bv;
            return true;
        }
        if (node->type != YAML_SCALAR_NODE || ht_config_classify(node, &iv, &dv, &bv) != SC_STR ||
            !node_string(node, sp->path, sizeof(sp->path)) || !sp->path[0])
            return false; /* a number is no directory: quote one named so */
        sp->on = true;
        return expand_path(sp->path, sizeof(sp->path), why, why_size);
    }
    case KT_STEPS: {
        ht_config_steps *st = dst;
        memset(st, 0, sizeof(*st));
        if (node_is_null(node)) return true;
        if (node->type == YAML_SCALAR_NODE && ht_config_classify(node, &iv, &dv, &bv) == SC_BOOL) {
            st->on = bv;
            return true;
        }
        if (node->type != YAML_SEQUENCE_NODE || seq_len(node) == 0 || seq_len(node) > HT_CONFIG_STEPS_MAX) return false;
        for (int i = 0; i < seq_len(node); i++) {
            if (!node_int(seq_item(doc, node, i), 1, INT64_MAX, &iv)) return false;
            st->items[i] = (int64_t)iv;
        }
        st->count = seq_len(node);
        st->on = true;
        return true;
    }
    case KT_REJECT: return (k->flags & AUTO_OK) && (node_is_null(node) || node_int(node, -1, -1, &iv));
    }
    return false;
}

/* Sets key i of cfg from node (its key on `line`), recording the source and
 * the alias `via` that named it (-1: its own name); cfg is unchanged on error. */
static ht_status assign(ht_config *cfg, int i, yaml_document_t *doc, const yaml_node_t *node, int line, const origin *o,
                        int via, ht_error *err) {
    const key_desc *k = &ht_config_keys[i];
    void *tmp = k->size ? calloc(1, k->size) : NULL; /* zeroed: equal configs are equal bytes */
    if (k->size && !tmp) return ht_fail(err, HT_ERR_OOM, "%s: out of memory", k->path);
    char why[256];
    bool ok = convert(k, doc, node, tmp, why, sizeof(why));
    if (ok && via >= 0 && ht_config_aliases[via].negated && k->type == KT_BOOL) *(bool *)tmp = !*(bool *)tmp;
    if (ok) {
        if (k->size) memcpy((char *)cfg + k->offset, tmp, k->size);
        /* HyperParallel's spelling of the optimizer says whose defaults apply
         * (on the command line too); the other dialects are told by their files. */
        bool hp_name =
            strcmp(k->path, "optimizer._target_") == 0 && strncmp(scalar_text(node), "hyper_parallel.", 15) == 0;
        if (hp_name && cfg->dialect == HT_CONFIG_DIALECT_HYPERTRAIN) cfg->dialect = HT_CONFIG_DIALECT_HYPERPARALLEL;
        if (!hp_name && strcmp(k->path, "optimizer._target_") == 0 && cfg->dialect == HT_CONFIG_DIALECT_HYPERPARALLEL)
            cfg->dialect = HT_CONFIG_DIALECT_HYPERTRAIN;
        cfg->source[i] = (uint8_t)o->source;
        cfg->line[i] = o->source == HT_CONFIG_SOURCE_FILE ? line : 0;
        cfg->alias[i] = (uint8_t)(via + 1);
    }
    free(tmp);
    if (ok) return HT_OK;
    key_desc named = *k; /* the message names the key as it was written */
    if (via >= 0) named.path = ht_config_aliases[via].alias;
    return type_error(&named, o, line, node, why, err);
}

/* Whether key i's current value was set by its own name or an alias that is another spelling of it (not weakly). */
static bool set_by_own_name(const ht_config *cfg, int i) {
    int a = cfg->alias[i] - 1;
    return a < 0 || (ht_config_aliases[a].key && strcmp(ht_config_aliases[a].key, ht_config_keys[i].path) == 0);
}

/* A weak write (a shared value) loses to the key's own name in the same source, and to any higher source. */
static bool weak_may_set(const ht_config *cfg, int i, const origin *o) {
    if (cfg->source[i] != o->source) return cfg->source[i] < o->source;
    return !set_by_own_name(cfg, i);
}

/* Sets what alias a names from node: its key, its shared keys, what it implies. cfg is unchanged on error. */
static ht_status assign_alias(ht_config *cfg, int a, yaml_document_t *doc, const yaml_node_t *node, int line,
                              const origin *o, ht_error *err) {
    const key_alias *A = &ht_config_aliases[a];
    /* Type-check against every shared key first, so that a failure leaves nothing half set. */
    for (int s = 0; s < 2 && A->shared[s]; s++) {
        const key_desc *k = &ht_config_keys[ht_config_key_index_exact(A->shared[s])];
        void *tmp = calloc(1, k->size);
        if (!tmp) return ht_fail(err, HT_ERR_OOM, "%s: out of memory", A->alias);
        char why[256];
        bool ok = convert(k, doc, node, tmp, why, sizeof(why));
        free(tmp);
        if (!ok) {
            key_desc named = *k;
            named.path = A->alias;
            return type_error(&named, o, line, node, why, err);
        }
    }
    if (A->key) {
        ht_status st = assign(cfg, ht_config_key_index_exact(A->key), doc, node, line, o, a, err);
        if (st != HT_OK) return st;
    }
    for (int s = 0; s < 2 && A->shared[s]; s++) {
        int i = ht_config_key_index_exact(A->shared[s]);
        if (!weak_may_set(cfg, i, o)) continue;
        ht_status st = assign(cfg, i, doc, node, line, o, a, err);
        if (st != HT_OK) return st;
    }
    if (A->implies && !node_is_null(node)) {
        const char *eq = strchr(A->implies, '=');
        char key[256];
        snprintf(key, sizeof(key), "%.*s", (int)(eq - A->implies), A->implies);
        int i = ht_config_key_index_exact(key);
        if (weak_may_set(cfg, i, o)) {
            ht_status st = ht_config_assign_text(cfg, i, eq + 1, o, a, err);
            if (st != HT_OK) return st;
            cfg->line[i] = o->source == HT_CONFIG_SOURCE_FILE ? line : 0;
        }
    }
    return HT_OK;
}

/* Parses `text` as one YAML value (a scalar or a flow sequence) and assigns it to key i
 * (via: the alias that named it, or -1; i < 0: alias `via` names it). */
ht_status ht_config_assign_text(ht_config *cfg, int i, const char *text, const origin *o, int via, ht_error *err) {
    yaml_parser_t parser;
    yaml_document_t doc;
    char where[HT_CONFIG_STR_MAX + 64];
    origin_prefix(o, 0, where, sizeof(where));
    if (!yaml_parser_initialize(&parser)) return ht_fail(err, HT_ERR_OOM, "%scannot start the YAML parser", where);
    if (!*text) text = "null";
    yaml_parser_set_input_string(&parser, (const unsigned char *)text, strlen(text));
    if (!yaml_parser_load(&parser, &doc)) {
        ht_fail(err, HT_ERR_CONFIG, "%s%s: the value is not valid YAML: %s", where,
                i >= 0     ? ht_config_keys[i].path
                : via >= 0 ? ht_config_aliases[via].alias
                           : "?",
                parser.problem ? parser.problem : "unknown problem");
        yaml_parser_delete(&parser);
        return HT_ERR_CONFIG;
    }
    yaml_node_t *root = yaml_document_get_root_node(&doc);
    ht_status st;
    if (!root)
        st = ht_fail(err, HT_ERR_CONFIG, "%s%s: no value", where,
                     i >= 0     ? ht_config_keys[i].path
                     : via >= 0 ? ht_config_aliases[via].alias
                                : "?");
    else if (i >= 0)
        st = assign(cfg, i, &doc, root, 0, o, via, err);
    else
        st = assign_alias(cfg, via, &doc, root, 0, o, err);
    yaml_document_delete(&doc);
    yaml_parser_delete(&parser);
    return st;
}

void ht_config_defaults(ht_config *cfg) {
    memset(cfg, 0, sizeof(*cfg));
    origin o = {NULL, NULL, HT_CONFIG_SOURCE_DEFAULT};
    for (int i = 0; i < ht_config_n_keys; i++) {
        if (!ht_config_keys[i].def) continue;
        ht_error err;
        /* Only a broken table entry can fail; test_config checks every default loads. */
        if (ht_config_assign_text(cfg, i, ht_config_keys[i].def, &o, -1, &err) != HT_OK)
            ht_log(HT_LOG_ERROR, "config table: %s", err.msg);
    }
}

/* ---------------------------------------------------------------- loading a file */

typedef struct loader {
    ht_config *cfg;
    yaml_document_t *doc;
    origin origin;
    int seen_line[HT_CONFIG_MAX_KEYS]; /* where this file set each key by one of its names, for duplicates */
    char seen_as[HT_CONFIG_MAX_KEYS][256];
    int alias_line[HT_CONFIG_MAX_ALIASES]; /* where this file used each alias, for two names of one shared value */
    char alias_as[HT_CONFIG_MAX_ALIASES][256];
} loader;

/* Another alias for the same shared value as alias a (learning_rate and base_lr) already used in this file. */
static int seen_same_shared(const loader *L, int a) {
    const key_alias *A = &ht_config_aliases[a];
    if (A->key || !A->shared[0]) return -1;
    for (int b = 0; b < ht_config_n_aliases; b++) {
        const key_alias *B = &ht_config_aliases[b];
        if (b != a && L->alias_line[b] && !B->key && B->shared[0] && strcmp(A->shared[0], B->shared[0]) == 0 &&
            strcmp(A->shared[1] ? A->shared[1] : "", B->shared[1] ? B->shared[1] : "") == 0)
            return b;
    }
    return -1;
}

/* MindFormers declares its optimizer and lr_scheduler sections allow_extra:
 * keys beyond its field tables are passed on (to an optimizer's or a
 * schedule's constructor) rather than refused. Here they have nothing to go
 * to: they are kept, and the log names each as ignored. */
static bool allows_extra_keys(const ht_config *cfg, const char *path) {
    char buf[256];
    path = ht_config_canonical_path(path, buf, sizeof(buf));
    return cfg->dialect == HT_CONFIG_DIALECT_MINDFORMERS &&
           (has_prefix_dot(path, "optimizer") || has_prefix_dot(path, "lr_scheduler"));
}

/* A section is a proper dotted prefix of some key ("optimizer", "optimizer.muon_config"). */
static bool is_section(const char *path) {
    char buf[256];
    path = ht_config_canonical_path(path, buf, sizeof(buf));
    for (int i = 0; i < ht_config_n_keys; i++)
        if (has_prefix_dot(ht_config_keys[i].path, path)) return true;
    for (int a = 0; a < ht_config_n_aliases; a++)
        if (has_prefix_dot(ht_config_aliases[a].alias, path)) return true;
    return false;
}

static ht_status load_mapping(loader *L, const yaml_node_t *map, const char *prefix, ht_error *err) {
    char where[HT_CONFIG_STR_MAX + 64];
    for (yaml_node_pair_t *p = map->data.mapping.pairs.start; p < map->data.mapping.pairs.top; p++) {
        yaml_node_t *key = yaml_document_get_node(L->doc, p->key);
        yaml_node_t *value = yaml_document_get_node(L->doc, p->value);
        origin_prefix(&L->origin, node_line(key), where, sizeof(where));
        if (key->type != YAML_SCALAR_NODE) {
            char found[160];
            describe(key, found, sizeof(found));
            return ht_fail(err, HT_ERR_CONFIG, "%s%s: expected a key name, found %s", where,
                           *prefix ? prefix : "top level", found);
        }
        const char *name = scalar_text(key);
        char path[256];
        if (snprintf(path, sizeof(path), "%s%s%s", prefix, *prefix ? "." : "", name) >= (int)sizeof(path))
            return ht_fail(err, HT_ERR_CONFIG, "%s%.64s...: unknown key (too long)", where, path);
        /* The same name twice, or a section and its alias (lr_scheduler, lr_schedule). */
        char canon[256], prev_path[256], prev_canon[256];
        snprintf(canon, sizeof(canon), "%s", ht_config_canonical_path(path, prev_canon, sizeof(prev_canon)));
        for (yaml_node_pair_t *q = map->data.mapping.pairs.start; q < p; q++) {
            yaml_node_t *prev = yaml_document_get_node(L->doc, q->key);
            if (prev->type != YAML_SCALAR_NODE) continue;
            snprintf(prev_path, sizeof(prev_path), "%s%s%s", prefix, *prefix ? "." : "", scalar_text(prev));
            if (strcmp(ht_config_canonical_path(prev_path, prev_canon, sizeof(prev_canon)), canon) == 0)
                return ht_fail(err, HT_ERR_CONFIG, "%s%s: duplicate key (first set on line %d%s%s)", where, path,
                               node_line(prev), strcmp(prev_path, path) ? " as " : "",
                               strcmp(prev_path, path) ? prev_path : "");
        }
        int i = ht_config_key_index_exact(canon), a = i < 0 ? ht_config_alias_index_in(L->cfg, path) : -1;
        if (i < 0 && a >= 0 && ht_config_aliases[a].key) i = ht_config_key_index_exact(ht_config_aliases[a].key);
        if (i >= 0 || a >= 0) {
            /* Two names of one key in one file is a duplicate; a shared value is not (the key's own name wins). */
            if (i >= 0 && L->seen_line[i])
                return ht_fail(err, HT_ERR_CONFIG, "%s%s: duplicate key: %s was already set on line %d as %s", where,
                               path, ht_config_keys[i].path, L->seen_line[i], L->seen_as[i]);
            int other = a >= 0 ? seen_same_shared(L, a) : -1;
            if (other >= 0)
                return ht_fail(err, HT_ERR_CONFIG,
                               "%s%s: %s was already given on line %d; they are two names for one value (the "
                               "schedule's base lr), give one of them",
                               where, path, L->alias_as[other], L->alias_line[other]);
            ht_status st = a >= 0 ? assign_alias(L->cfg, a, L->doc, value, node_line(key), &L->origin, err)
                                  : assign(L->cfg, i, L->doc, value, node_line(key), &L->origin, -1, err);
            if (st != HT_OK) return st;
            if (a >= 0) {
                L->alias_line[a] = node_line(key);
                snprintf(L->alias_as[a], sizeof(L->alias_as[a]), "%s", path);
            }
            if (i >= 0) {
                L->seen_line[i] = node_line(key);
                snprintf(L->seen_as[i], sizeof(L->seen_as[i]), "%s", path);
            }
        } else if (is_section(path)) {
            if (node_is_null(value)) continue; /* an empty section */
            if (value->type != YAML_MAPPING_NODE) {
                char found[160];
                describe(value, found, sizeof(found));
                return ht_fail(err, HT_ERR_CONFIG, "%s%s: expected a mapping (a section of keys), found %s", where,
                               path, found);
            }
            ht_status st = load_mapping(L, value, path, err);
            if (st != HT_OK) return st;
        } else if (allows_extra_keys(L->cfg, path)) {
            ht_config *cfg = L->cfg;
            if (cfg->ignored_count == HT_CONFIG_IGNORED_MAX)
                return ht_fail(err, HT_ERR_CONFIG, "%s%s: more than %d keys hypertrain does not use", where, path,
                               HT_CONFIG_IGNORED_MAX);
            snprintf(cfg->ignored[cfg->ignored_count], sizeof(cfg->ignored[0]), "%s", path);
            cfg->ignored_line[cfg->ignored_count++] = node_line(key);
        } else {
            return ht_config_unknown_key(where, path, err);
        }
    }
    return HT_OK;
}

static ht_status yaml_problem(const char *path, const yaml_parser_t *parser, ht_error *err) {
    const char *problem = parser->problem ? parser->problem : "unknown problem";
    if (parser->error == YAML_MEMORY_ERROR) return ht_fail(err, HT_ERR_OOM, "%s: out of memory parsing YAML", path);
    if (parser->context)
        return ht_fail(err, HT_ERR_CONFIG, "%s:%zu: not valid YAML: %s (column %zu), %s (line %zu)", path,
                       parser->problem_mark.line + 1, problem, parser->problem_mark.column + 1, parser->context,
                       parser->context_mark.line + 1);
    return ht_fail(err, HT_ERR_CONFIG, "%s:%zu: not valid YAML: %s (column %zu)", path, parser->problem_mark.line + 1,
                   problem, parser->problem_mark.column + 1);
}

/* A configuration is a few kilobytes; these bounds keep a hostile file from
 * costing minutes: libyaml's time grows with the square of flow nesting
 * (100,000 levels of "[" took 20 s). */
#define CONFIG_FILE_MAX (1 << 20)
#define CONFIG_NESTING_MAX 64

/* The deepest flow nesting ([ and {) outside quotes and comments, and its line. */
static int flow_depth(const char *text, size_t size, size_t *line_out) {
    int depth = 0, deepest = 0;
    size_t line = 1;
    char quote = 0;
    for (size_t i = 0; i < size; i++) {
        char ch = text[i];
        if (ch == '\n') {
            line++;
            if (quote == '#') quote = 0;
            continue;
        }
        if (quote) {
            if (ch == quote && quote != '#')
                quote = 0;
            else if (quote == '"' && ch == '\\' && i + 1 < size)
                i++;
            continue;
        }
        if (ch == '"' || ch == '\'')
            quote = ch;
        else if (ch == '#' && (i == 0 || text[i - 1] == ' ' || text[i - 1] == '\t' || text[i - 1] == '\n'))
            quote = '#';
        else if (ch == '[' || ch == '{') {
            if (++depth > deepest) {
                deepest = depth;
                *line_out = line;
            }
            if (deepest > CONFIG_NESTING_MAX) return deepest;
        } else if ((ch == ']' || ch == '}') && depth > 0) {
            depth--;
        }
    }
    return deepest;
}
static ht_status load_file(ht_config *cfg, const char *path, ht_error *err) {
    char *text = NULL;
    size_t size = 0;
    ht_error io;
    /* The cap is checked on the file's size, before a byte is read. */
    ht_status read = ht_read_file_max(path, CONFIG_FILE_MAX, "a configuration may have", &text, &size, &io);
    if (read == HT_ERR_FORMAT)
        return ht_fail(err, HT_ERR_CONFIG, "%s: %zu bytes; expected a configuration of at most %d bytes", path, size,
                       CONFIG_FILE_MAX);
    if (read != HT_OK) return ht_fail(err, io.status, "config file %s (expected a readable YAML file)", io.msg);
    size_t deep_line = 0;
    if (flow_depth(text, size, &deep_line) > CONFIG_NESTING_MAX) {
        free(text);
        return ht_fail(err, HT_ERR_CONFIG, "%s:%zu: brackets nested deeper than %d levels; expected a configuration",
                       path, deep_line, CONFIG_NESTING_MAX);
    }
    if (strlen(path) >= sizeof(cfg->file)) {
        free(text);
        return ht_fail(err, HT_ERR_CONFIG, "%s: the path is longer than %d bytes", path, HT_CONFIG_STR_MAX - 1);
    }
    snprintf(cfg->file, sizeof(cfg->file), "%s", path);

    yaml_parser_t parser;
    yaml_document_t doc, extra;
    if (!yaml_parser_initialize(&parser)) {
        free(text);
        return ht_fail(err, HT_ERR_OOM, "%s: cannot start the YAML parser", path);
    }
    yaml_parser_set_input_string(&parser, (const unsigned char *)text, size);
    ht_status st = HT_OK;
    if (!yaml_parser_load(&parser, &doc)) {
        st = yaml_problem(path, &parser, err);
        yaml_parser_delete(&parser);
        free(text);
        return st;
    }
    yaml_node_t *root = yaml_document_get_root_node(&doc);
    if (!root || node_is_null(root)) {
        st = ht_fail(err, HT_ERR_CONFIG,
                     "%s: the file is empty; expected a mapping of sections (model:, data:, "
                     "optimizer:, lr_scheduler:, training:, fsdp_config:, checkpoint:)",
                     path);
    } else if (root->type != YAML_MAPPING_NODE) {
        char found[160];
        describe(root, found, sizeof(found));
        st = ht_fail(err, HT_ERR_CONFIG,
                     "%s:%d: top level: expected a mapping of sections (model:, data:, ...), "
                     "found %s",
                     path, node_line(root), found);
    } else {
        loader *L = calloc(1, sizeof(loader));
        if (!L) {
            st = ht_fail(err, HT_ERR_OOM, "%s: out of memory", path);
        } else {
            L->cfg = cfg;
            L->doc = &doc;
            L->origin = (origin){cfg->file, NULL, HT_CONFIG_SOURCE_FILE};
            ht_config_detect_dialect(&doc, root, cfg);
            st = load_mapping(L, root, "", err);
            free(L);
        }
    }
    if (st == HT_OK) {
        /* A second document would be silently ignored otherwise. */
        if (!yaml_parser_load(&parser, &extra)) {
            st = yaml_problem(path, &parser, err);
        } else {
            yaml_node_t *second = yaml_document_get_root_node(&extra);
            if (second)
                st = ht_fail(err, HT_ERR_CONFIG, "%s:%d: a second YAML document; expected exactly one", path,
                             node_line(second));
            yaml_document_delete(&extra);
        }
    }
    yaml_document_delete(&doc);
    yaml_parser_delete(&parser);
    free(text);
    return st;
}

ht_status ht_config_set(ht_config *cfg, const char *assignment, ht_error *err) {
    origin o = {NULL, assignment, HT_CONFIG_SOURCE_CLI};
    char where[HT_CONFIG_STR_MAX + 64];
    origin_prefix(&o, 0, where, sizeof(where));
    const char *eq = strchr(assignment, '=');
    if (!eq || eq == assignment)
        return ht_fail(err, HT_ERR_CONFIG, "%sexpected section.key=value, found %s", where,
                       eq ? "no key before '='" : "no '='");
    char path[256];
    size_t klen = (size_t)(eq - assignment);
    if (klen >= sizeof(path)) return ht_fail(err, HT_ERR_CONFIG, "%sunknown key (too long)", where);
    memcpy(path, assignment, klen);
    path[klen] = '\0';
    char buf[256];
    int i = ht_config_key_index_exact(ht_config_canonical_path(path, buf, sizeof(buf))),
        a = i < 0 ? ht_config_alias_index_in(cfg, path) : -1;
    if (a >= 0) return ht_config_assign_text(cfg, -1, eq + 1, &o, a, err);
    if (i < 0) {
        if (is_section(path)) {
            char keys[1024];
            ht_config_list_children(path, keys, sizeof(keys));
            return ht_fail(err, HT_ERR_CONFIG, "%s%s is a section; set one of its keys (%s.KEY=VALUE): %s", where, path,
                           path, keys);
        }
        return ht_config_unknown_key(where, path, err);
    }
    return ht_config_assign_text(cfg, i, eq + 1, &o, -1, err);
}

ht_status ht_config_load(const char *path, int n_overrides, char *const *overrides, ht_config *cfg, ht_error *err) {
    ht_config_defaults(cfg);
    if (path) {
        ht_status st = load_file(cfg, path, err);
        if (st != HT_OK) return st;
    }
    for (int i = 0; i < n_overrides; i++) {
        ht_status st = ht_config_set(cfg, overrides[i], err);
        if (st != HT_OK) return st;
    }
    ht_config_apply_dialect_defaults(cfg);
    return ht_config_resolve_parts(cfg, err);
}
