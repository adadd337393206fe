/* Name -> function registries (models, datasets): one mechanism for the
 * built-ins, which register on first use, and for plugins. */
#include <stdio.h>
#include <string.h>

#include "hypertrain/base.h"

static void ensure_builtins(ht_registry *r) {
    if (r->builtins_done) return;
    r->builtins_done = true; /* first: the built-ins register through ht_registry_add */
    if (r->register_builtins) r->register_builtins();
}

ht_status ht_registry_add(ht_registry *r, const char *name, ht_registry_fn fn, ht_error *err) {
    ensure_builtins(r);
    if (!name || !*name || strlen(name) >= HT_REGISTRY_NAME_MAX)
        return ht_fail(err, HT_ERR_INVALID, "%s name '%s' must have 1 to %d characters", r->what, name ? name : "",
                       HT_REGISTRY_NAME_MAX - 1);
    if (!fn) return ht_fail(err, HT_ERR_INVALID, "%s '%s': the function is NULL", r->what, name);
    for (int i = 0; i < r->count; i++)
        if (strcmp(r->names[i], name) == 0)
            return ht_fail(err, HT_ERR_INVALID, "%s '%s' is already registered", r->what, name);
    if (r->count == HT_REGISTRY_MAX)
        return ht_fail(err, HT_ERR_INVALID, "cannot register %s '%s': the registry holds %d already", r->what, name,
                       HT_REGISTRY_MAX);
    snprintf(r->names[r->count], HT_REGISTRY_NAME_MAX, "%s", name);
    r->fns[r->count] = fn;
    r->count++;
    return HT_OK;
}

ht_registry_fn ht_registry_find(ht_registry *r, const char *name) {
    ensure_builtins(r);
    for (int i = 0; i < r->count; i++)
        if (strcmp(r->names[i], name) == 0) return r->fns[i];
    return NULL;
}

const char *ht_registry_names(ht_registry *r) {
    ensure_builtins(r);
    r->list[0] = '\0';
    for (int i = 0; i < r->count; i++) {
        if (i) strcat(r->list, ", ");
        strcat(r->list, r->names[i]);
    }
    return r->list;
}
