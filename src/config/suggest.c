/* Unknown keys: the closest known key, alias or section by edit distance
 * when it is close enough to be a typo, else the keys of the section. */
#include "config/config_internal.h"

#include <limits.h>
#include <stdio.h>
#include <string.h>

static int edit_distance(const char *a, const char *b) {
    size_t la = strlen(a), lb = strlen(b);
    if (la > 200 || lb > 200) return INT_MAX;
    int row[201];
    for (size_t j = 0; j <= lb; j++) row[j] = (int)j;
    for (size_t i = 1; i <= la; i++) {
        int diag = row[0];
        row[0] = (int)i;
        for (size_t j = 1; j <= lb; j++) {
            int up = row[j];
            int best = diag + (a[i - 1] != b[j - 1]);
            if (up + 1 < best) best = up + 1;
            if (row[j - 1] + 1 < best) best = row[j - 1] + 1;
            row[j] = best;
            diag = up;
        }
    }
    return row[lb];
}

static void consider(const char *cand, const char *path, const char **best, int *best_d) {
    int d = edit_distance(path, cand);
    if (d < *best_d) {
        *best_d = d;
        *best = cand;
    }
}

/* The closest known key or section, when it is close enough to be a typo. */
const char *ht_config_suggest(const char *path, char *buf, size_t n) {
    const char *best = NULL;
    int best_d = INT_MAX;
    for (int i = 0; i < ht_config_n_keys; i++) {
        consider(ht_config_keys[i].path, path, &best, &best_d);
        /* Sections: every dotted prefix of the key. */
        char prefix[256];
        snprintf(prefix, sizeof(prefix), "%s", ht_config_keys[i].path);
        for (char *dot = strrchr(prefix, '.'); dot; dot = strrchr(prefix, '.')) {
            *dot = '\0';
            int d = edit_distance(path, prefix);
            if (d < best_d) {
                best_d = d;
                snprintf(buf, n, "%s", prefix);
                best = buf;
            }
        }
    }
    for (int a = 0; a < ht_config_n_aliases; a++) consider(ht_config_aliases[a].alias, path, &best, &best_d);
    int limit = (int)strlen(path) / 4;
    if (limit < 1) limit = 1;
    if (limit > 3) limit = 3;
    if (!best || best_d > limit) return NULL;
    if (best != buf) snprintf(buf, n, "%s", best);
    return buf;
}

/* "the keys of training are: steps, local_batch_size, ..." (canonical, direct children). */
void ht_config_list_children(const char *section, char *buf, size_t n) {
    size_t used = 0;
    buf[0] = '\0';
    size_t plen = section ? strlen(section) + 1 : 0;
    for (int i = 0; i < ht_config_n_keys && used + 1 < n; i++) {
        if (section && !has_prefix_dot(ht_config_keys[i].path, section)) continue;
        if (ht_config_keys[i].type == KT_REJECT) continue;
        const char *child = ht_config_keys[i].path + plen;
        size_t clen = strcspn(child, ".");
        bool dup = false;
        for (int j = 0; j < i && !dup; j++) {
            if (section && !has_prefix_dot(ht_config_keys[j].path, section)) continue;
            const char *other = ht_config_keys[j].path + plen;
            dup = strcspn(other, ".") == clen && strncmp(other, child, clen) == 0;
        }
        if (dup) continue;
        used += (size_t)snprintf(buf + used, n - used, "%s%.*s", used ? ", " : "", (int)clen, child);
    }
}

ht_status ht_config_unknown_key(const char *where, const char *path, ht_error *err) {
    char hint[256], keys[1024];
    if (ht_config_suggest(path, hint, sizeof(hint)))
        return ht_fail(err, HT_ERR_CONFIG, "%s%s: unknown key (did you mean %s?)", where, path, hint);
    char section[256];
    snprintf(section, sizeof(section), "%s", path);
    char *dot = strrchr(section, '.');
    if (dot) *dot = '\0';
    ht_config_list_children(dot ? section : NULL, keys, sizeof(keys));
    return ht_fail(err, HT_ERR_CONFIG, "%s%s: unknown key; expected one of: %s", where, path, keys);
}
