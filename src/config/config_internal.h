/* Inside config/: the key table's types and its tables (keys.c), and what the
 * loader (load.c), the dialects (dialects.c), the formatting and the log
 * (format.c) and the suggestions for unknown keys (suggest.c) share. */
#ifndef HT_CONFIG_CONFIG_INTERNAL_H
#define HT_CONFIG_CONFIG_INTERNAL_H

#include "hypertrain/config.h"

#include <stddef.h>
#include <string.h>
#include <yaml.h>

typedef enum key_type {
    KT_INT,         /* int */
    KT_I64,         /* int64_t */
    KT_FLOAT,       /* double */
    KT_BOOL,        /* bool: true | false */
    KT_STR,         /* char[size] */
    KT_ENUM,        /* an int-sized enum, by name */
    KT_DTYPE,       /* ht_dtype: float16 | bfloat16 | float32 */
    KT_STRS,        /* ht_config_strings */
    KT_FLOATS,      /* double[size / sizeof(double)] */
    KT_LAYERS,      /* ht_layer_list: a list of layer indices */
    KT_NS,          /* ht_config_ns_coefficients */
    KT_SHARD,       /* int: auto (0) or a positive integer */
    KT_AUTO_INT,    /* int: auto (-1) or an integer >= 0 */
    KT_SWITCH_PATH, /* ht_config_switch_path: true | false | null (false) | a directory */
    KT_STEPS,       /* ht_config_steps: true | false | null (false) | a list of steps >= 1 */
    KT_REJECT,      /* a key some dialects know that is an error here */
} key_type;

#define NULLABLE 1u
#define AUTO_OK 2u /* KT_REJECT: null or -1 ("derive it") is accepted and changes nothing */
#define FS_PATH 4u /* KT_STR, KT_STRS: a file system path; a leading ~ is expanded as a shell would (load.c) */

typedef struct enum_name {
    const char *name;
    int value;
    bool hidden; /* accepted, but not listed in "expected one of" */
} enum_name;

typedef struct key_desc {
    const char *path; /* dotted, canonical */
    key_type type;
    size_t offset, size;
    const char *def;        /* default, as YAML text (NULL for KT_REJECT) */
    const enum_name *names; /* KT_ENUM; KT_REJECT: names[0].name is the message */
    unsigned flags;
} key_desc;

/* When an alias applies: one name may mean different keys in different blocks. */
typedef enum alias_when {
    WHEN_ALWAYS = 0,
    WHEN_MINDFORMERS_MUON,     /* a MindFormers optimizer block of type Muon */
    WHEN_NOT_MINDFORMERS_MUON, /* any other */
} alias_when;

typedef struct key_alias {
    const char *alias;
    const char *key;       /* the key this is another spelling of, or NULL */
    const char *shared[2]; /* keys that take this one value (weakly) */
    const char *implies;   /* "key=value" also set (weakly) when the value is not null */
    alias_when when;
    bool negated; /* a bool key set to the opposite of the alias's value (no_save_optim: save_optimizer) */
} key_alias;

/* Capacity of a per-alias array: ht_config.alias holds an alias's index + 1 in a uint8_t. */
#define HT_CONFIG_MAX_ALIASES 254

/* keys.c: the tables, and lookups by a canonical path. */
extern const key_desc ht_config_keys[];
extern const int ht_config_n_keys;
extern const key_alias ht_config_aliases[];
extern const int ht_config_n_aliases;
const char *ht_config_canonical_path(const char *path, char *buf, size_t n);
int ht_config_key_index_exact(const char *path);
int ht_config_alias_index_in(const ht_config *cfg, const char *path);

static inline bool has_prefix_dot(const char *s, const char *prefix) {
    size_t n = strlen(prefix);
    return strncmp(s, prefix, n) == 0 && s[n] == '.';
}

/* Where a value came from, for the front of a message: "f.yaml:12: " or "--set k=v: ". */
typedef struct origin {
    const char *file;    /* the file, or NULL */
    const char *set_arg; /* the --set argument, or NULL */
    ht_config_source source;
} origin;

typedef enum scalar_kind { SC_NULL, SC_BOOL, SC_INT, SC_FLOAT, SC_STR } scalar_kind;

static inline const char *scalar_text(const yaml_node_t *node) { return (const char *)node->data.scalar.value; }

/* load.c: a scalar's YAML type; one value, as YAML text, set to a key. */
scalar_kind ht_config_classify(const yaml_node_t *node, long long *iv, double *dv, bool *bv);
ht_status ht_config_assign_text(ht_config *cfg, int i, const char *text, const origin *o, int via, ht_error *err);

/* suggest.c: what an unknown key may have meant. */
const char *ht_config_suggest(const char *path, char *buf, size_t n);
void ht_config_list_children(const char *section, char *buf, size_t n);
ht_status ht_config_unknown_key(const char *where, const char *path, ht_error *err);

/* dialects.c: whose YAML a file is, and what that changes once it is read. */
void ht_config_detect_dialect(yaml_document_t *doc, const yaml_node_t *root, ht_config *cfg);
void ht_config_apply_dialect_defaults(ht_config *cfg);
ht_status ht_config_resolve_parts(ht_config *cfg, ht_error *err);

#endif
