/* Byte-level BPE tokenizers read from a Hugging Face tokenizer.json (GPT-2's,
 * Qwen2's, Llama 3's): the added tokens, the pre-tokenizer's regular
 * expression written out by hand (Qwen2's and Llama 3's, or GPT-2's), the
 * BPE merges by rank, the post-processor's leading special tokens; and the
 * way back from ids to bytes. */
#include <stdlib.h>
#include <string.h>

#include "data/unicode_tables.h"
#include "hypertrain/data.h"

/* Split patterns this file implements, as tokenizer.json spells them. */
static const char QWEN2_PATTERN[] = "(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}| "
                                    "?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+";
static const char LLAMA3_PATTERN[] = "(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}{1,3}| "
                                     "?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+";

/* A string -> int32 map, open addressing over FNV-1a; keys borrowed. */
typedef struct slot {
    const char *key;
    uint32_t len;
    int32_t value;
} slot;
typedef struct table {
    slot *slots;
    size_t mask;
} table;

static bool table_init(table *t, size_t n) {
    size_t cap = 16;
    while (cap < 2 * n) cap <<= 1;
    t->slots = calloc(cap, sizeof(slot));
    t->mask = cap - 1;
    return t->slots != NULL;
}

static slot *table_slot(const table *t, const char *key, size_t len) {
    size_t i = (size_t)ht_fnv1a64(key, len, HT_FNV64_INIT) & t->mask;
    while (t->slots[i].key && !(t->slots[i].len == len && memcmp(t->slots[i].key, key, len) == 0))
        i = (i + 1) & t->mask;
    return &t->slots[i];
}

static int32_t table_get(const table *t, const char *key, size_t len) {
    const slot *s = table_slot(t, key, len);
    return s->key ? s->value : -1;
}

typedef struct added_token {
    const char *content;
    size_t len;
    int32_t id;
} added_token;

typedef enum pattern { PATTERN_GPT2 = 0, PATTERN_QWEN2, PATTERN_LLAMA3 } pattern;

struct ht_tokenizer {
    char *strings; /* every token's text and merge key, one block */
    const char **tokens;
    uint32_t *token_len;
    int32_t count; /* ids [0, count) */
    table vocab, merges;
    added_token *added;
    int added_count;
    pattern pattern;
    bool prefix_space, ignore_merges;
    int32_t prefix[8]; /* the post-processor's tokens before the text (Llama 3's <|begin_of_text|>) */
    int prefix_count;
    uint32_t byte_char[256]; /* GPT-2's bytes_to_unicode */
    int16_t char_byte[512];  /* its inverse (every mapped code point is below 512), -1 elsewhere */
};

/* ------------------------------------------------------------------ Unicode */

static bool in_ranges(const uint32_t (*r)[2], size_t n, uint32_t cp) {
    size_t lo = 0, hi = n;
    while (lo < hi) {
        size_t mid = (lo + hi) / 2;
        if (cp < r[mid][0])
            hi = mid;
        else if (cp > r[mid][1])
            lo = mid + 1;
        else
            return true;
    }
    return false;
}
static bool is_letter(uint32_t c) {
    if (c < 128) return (c | 32) >= 'a' && (c | 32) <= 'z';
    return in_ranges(UNICODE_LETTERS, sizeof(UNICODE_LETTERS) / sizeof(UNICODE_LETTERS[0]), c);
}
static bool is_number(uint32_t c) {
    if (c < 128) return c >= '0' && c <= '9';
    return in_ranges(UNICODE_NUMBERS, sizeof(UNICODE_NUMBERS) / sizeof(UNICODE_NUMBERS[0]), c);
}
/* \s: Unicode's White_Space. */
static bool is_space(uint32_t c) {
    return (c >= 9 && c <= 13) || c == ' ' || c == 0x85 || c == 0xA0 || c == 0x1680 || (c >= 0x2000 && c <= 0x200A) ||
           c == 0x2028 || c == 0x2029 || c == 0x202F || c == 0x205F || c == 0x3000;
}
static bool is_newline(uint32_t c) { return c == '\r' || c == '\n'; }
static bool is_other(uint32_t c) { return !is_space(c) && !is_letter(c) && !is_number(c); }

/* The code points of s[0, len) into cps, each one's byte offset into offs
 * (offs[n] = len); -1 where s is not UTF-8. */
static long decode_utf8(const unsigned char *s, size_t len, uint32_t *cps, size_t *offs) {
    size_t n = 0;
    for (size_t i = 0; i < len;) {
        unsigned char b = s[i];
        int more = b < 0x80 ? 0 : (b & 0xE0) == 0xC0 ? 1 : (b & 0xF0) == 0xE0 ? 2 : (b & 0xF8) == 0xF0 ? 3 : -1;
        if (more < 0 || i + (size_t)more >= len + (more ? 0 : 1)) return -1;
        uint32_t cp = more == 0 ? b : (uint32_t)(b & (0x3F >> more));
        for (int k = 1; k <= more; k++) {
            if ((s[i + k] & 0xC0) != 0x80) return -1;
            cp = cp << 6 | (s[i + k] & 0x3F);
        }
        offs[n] = i;
        cps[n++] = cp;
        i += (size_t)more + 1;
    }
    offs[n] = len;
    return (long)n;
}

static size_t encode_utf8(uint32_t cp, char *out) {
    if (cp < 0x80) return out[0] = (char)cp, 1;
    if (cp < 0x800) return out[0] = (char)(0xC0 | cp >> 6), out[1] = (char)(0x80 | (cp & 0x3F)), 2;
    if (cp < 0x10000)
        return out[0] = (char)(0xE0 | cp >> 12), out[1] = (char)(0x80 | (cp >> 6 & 0x3F)),
               out[2] = (char)(0x80 | (cp & 0x3F)), 3;
    out[0] = (char)(0xF0 | cp >> 18), out[1] = (char)(0x80 | (cp >> 12 & 0x3F));
    out[2] = (char)(0x80 | (cp >> 6 & 0x3F)), out[3] = (char)(0x80 | (cp & 0x3F));
    return 4;
}

/* ------------------------------------------------------------------ the pre-tokenizers */

static uint32_t lower(uint32_t c) { return c >= 'A' && c <= 'Z' ? c + 32 : c; }

/* The length of the contraction ('s, 't, 're, 've, 'm, 'll, 'd) at cps[i], 0 if none. */
static size_t contraction(const uint32_t *cps, size_t n, size_t i, bool any_case) {
    if (cps[i] != '\'' || i + 1 >= n) return 0;
    uint32_t a = any_case ? lower(cps[i + 1]) : cps[i + 1],
             b = i + 2 < n ? (any_case ? lower(cps[i + 2]) : cps[i + 2]) : 0;
    if (a == 's' || a == 't' || a == 'm' || a == 'd') return 2;
    if ((a == 'r' && b == 'e') || (a == 'v' && b == 'e') || (a == 'l' && b == 'l')) return 3;
    return 0;
}

static size_t run(const uint32_t *cps, size_t n, size_t j, bool (*is)(uint32_t)) {
    while (j < n && is(cps[j])) j++;
    return j;
}

/* The whitespace alternatives every pattern ends with, at cps[i] (whitespace):
 * Qwen2's and Llama 3's \s*[\r\n]+ first (newlines), then \s+(?!\S), \s+. */
static size_t whitespace(const uint32_t *cps, size_t n, size_t i, bool newlines) {
    size_t e = run(cps, n, i, is_space);
    for (size_t j = e; newlines && j > i; j--)
        if (is_newline(cps[j - 1])) return j; /* \s* gives back down to the last newline */
    if (e == n || e - i == 1) return e;
    return e - 1; /* leaves the last space to the word after it */
}

/* The end of the piece that starts at cps[i], as the pattern's leftmost
 * alternative that matches there matches it. */
static size_t next_piece(pattern p, const uint32_t *cps, size_t n, size_t i) {
    const uint32_t c = cps[i];
    size_t k = contraction(cps, n, i, p != PATTERN_GPT2);
    if (k) return i + k;
    if (p == PATTERN_GPT2) { /* ' ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+' */
        bool (*classes[3])(uint32_t) = {is_letter, is_number, is_other};
        for (int a = 0; a < 3; a++) {
            size_t s = c == ' ' && i + 1 < n && classes[a](cps[i + 1]) ? i + 1 : i;
            if (classes[a](cps[s])) return run(cps, n, s + 1, classes[a]);
        }
        return whitespace(cps, n, i, false);
    }
    /* [^\r\n\p{L}\p{N}]?\p{L}+ */
    if (!is_newline(c) && !is_letter(c) && !is_number(c) && i + 1 < n && is_letter(cps[i + 1]))
        return run(cps, n, i + 2, is_letter);
    if (is_letter(c)) return run(cps, n, i + 1, is_letter);
    if (is_number(c)) { /* \p{N} (Qwen2), \p{N}{1,3} (Llama 3) */
        size_t j = i + 1, most = p == PATTERN_LLAMA3 ? 3 : 1;
        while (j < n && j - i < most && is_number(cps[j])) j++;
        return j;
    }
    /* ' ?[^\s\p{L}\p{N}]+[\r\n]*' */
    size_t s = c == ' ' && i + 1 < n && is_other(cps[i + 1]) ? i + 1 : i;
    if (is_other(cps[s])) return run(cps, n, run(cps, n, s + 1, is_other), is_newline);
    return whitespace(cps, n, i, true);
}

/* ------------------------------------------------------------------ BPE */

typedef struct ids {
    int32_t *v;
    int count, cap;
} ids;

static bool push(ids *o, int32_t id) {
    if (o->count == o->cap) {
        int cap = o->cap ? 2 * o->cap : 64;
        int32_t *v = realloc(o->v, (size_t)cap * sizeof(int32_t));
        if (!v) return false;
        o->v = v, o->cap = cap;
    }
    o->v[o->count++] = id;
    return true;
}

/* One piece's bytes: each byte as its GPT-2 character, then the merges by
 * rank (the lowest first, the leftmost of equals), each symbol's id. */
static ht_status bpe(const ht_tokenizer *t, const unsigned char *b, size_t m, ids *out, ht_error *err) {
    char *text = malloc(2 * m + 1), *key = malloc(4 * m + 2);
    size_t *start = malloc((m + 1) * sizeof(size_t)), n = 0, len = 0;
    ht_status s = HT_OK;
    if (!text || !key || !start) s = ht_fail(err, HT_ERR_OOM, "tokenizer: out of memory");
    for (size_t i = 0; s == HT_OK && i < m; i++) {
        start[n++] = len;
        len += encode_utf8(t->byte_char[b[i]], text + len);
    }
    if (s == HT_OK) start[n] = len;
    int32_t whole = s == HT_OK && t->ignore_merges ? table_get(&t->vocab, text, len) : -1;
    if (whole >= 0) {
        n = 0;
        if (!push(out, whole)) s = ht_fail(err, HT_ERR_OOM, "tokenizer: out of memory");
    }
    while (s == HT_OK && n > 1) {
        int32_t best = -1;
        size_t at = 0;
        for (size_t i = 0; i + 1 < n; i++) {
            size_t a = start[i + 1] - start[i], c = start[i + 2] - start[i + 1];
            memcpy(key, text + start[i], a);
            key[a] = ' ';
            memcpy(key + a + 1, text + start[i + 1], c);
            int32_t rank = table_get(&t->merges, key, a + 1 + c);
            if (rank >= 0 && (best < 0 || rank < best)) best = rank, at = i;
        }
        if (best < 0) break;
        memmove(start + at + 1, start + at + 2, (n - at - 1) * sizeof(size_t)); /* symbols at and at + 1 joined */
        n--;
    }
    for (size_t i = 0; s == HT_OK && i < n; i++) {
        int32_t id = table_get(&t->vocab, text + start[i], start[i + 1] - start[i]);
        if (id < 0)
            s = ht_fail(err, HT_ERR_FORMAT, "tokenizer: no token for \"%.*s\" (a byte-level vocabulary has every byte)",
                        (int)(start[i + 1] - start[i]), text + start[i]);
        else if (!push(out, id))
            s = ht_fail(err, HT_ERR_OOM, "tokenizer: out of memory");
    }
    free(text), free(key), free(start);
    return s;
}

/* Text without added tokens: pieces by the pattern, each piece by BPE. */
static ht_status encode_plain(const ht_tokenizer *t, const char *s, size_t len, ids *out, ht_error *err) {
    if (len == 0) return HT_OK;
    uint32_t *cps = malloc((len + 1) * sizeof(uint32_t));
    size_t *offs = malloc((len + 2) * sizeof(size_t));
    char *spaced = t->prefix_space && s[0] != ' ' ? malloc(len + 2) : NULL;
    ht_status st = cps && offs && (spaced || !t->prefix_space || s[0] == ' ')
                       ? HT_OK
                       : ht_fail(err, HT_ERR_OOM, "tokenizer: out of memory");
    if (st == HT_OK && spaced) { /* ByteLevel's add_prefix_space */
        spaced[0] = ' ';
        memcpy(spaced + 1, s, len);
        s = spaced, len++;
    }
    long n = st == HT_OK ? decode_utf8((const unsigned char *)s, len, cps, offs) : 0;
    if (n < 0) st = ht_fail(err, HT_ERR_INVALID, "tokenizer: the text is not UTF-8");
    for (size_t i = 0; st == HT_OK && i < (size_t)n;) {
        size_t j = next_piece(t->pattern, cps, (size_t)n, i);
        st = bpe(t, (const unsigned char *)s + offs[i], offs[j] - offs[i], out, err);
        i = j;
    }
    free(cps), free(offs), free(spaced);
    return st;
}

ht_status ht_tokenizer_encode(const ht_tokenizer *t, const char *text, size_t len, int32_t **out, int *count,
                              ht_error *err) {
    ids o = {0};
    ht_status s = HT_OK;
    for (int i = 0; i < t->prefix_count && s == HT_OK; i++)
        if (!push(&o, t->prefix[i])) s = ht_fail(err, HT_ERR_OOM, "tokenizer: out of memory");
    /* The added tokens first, the longest at each place; the text between them by the pattern and BPE. */
    size_t from = 0;
    for (size_t i = 0; s == HT_OK && i <= len; i++) {
        const added_token *hit = NULL;
        for (int a = 0; i < len && a < t->added_count; a++) {
            const added_token *at = &t->added[a];
            if (at->len <= len - i && memcmp(text + i, at->content, at->len) == 0 && (!hit || at->len > hit->len))
                hit = at;
        }
        if (!hit && i < len) continue;
        s = encode_plain(t, text + from, i - from, &o, err);
        if (s == HT_OK && hit && !push(&o, hit->id)) s = ht_fail(err, HT_ERR_OOM, "tokenizer: out of memory");
        if (hit) i += hit->len - 1;
        from = i + 1;
    }
    if (s != HT_OK) {
        free(o.v);
        return s;
    }
    *out = o.v;
    *count = o.count;
    return HT_OK;
}

size_t ht_tokenizer_decode(const ht_tokenizer *t, int32_t id, char *out, size_t cap) {
    if (id < 0 || id >= t->count || !t->tokens[id]) return 0;
    for (int a = 0; a < t->added_count; a++) /* added tokens are their text as it is */
        if (t->added[a].id == id) {
            size_t n = t->added[a].len < cap ? t->added[a].len : cap;
            memcpy(out, t->added[a].content, n);
            return n;
        }
    uint32_t cps[256];
    size_t offs[257], len = t->token_len[id] < 256 ? t->token_len[id] : 256, n = 0;
    long count = decode_utf8((const unsigned char *)t->tokens[id], len, cps, offs);
    for (long i = 0; i < count && n < cap; i++) {
        int16_t b = cps[i] < 512 ? t->char_byte[cps[i]] : -1;
        if (b >= 0) {
            out[n++] = (char)b;
        } else { /* not a byte's character: the text itself */
            char u[4];
            size_t k = encode_utf8(cps[i], u);
            for (size_t j = 0; j < k && n < cap; j++) out[n++] = u[j];
        }
    }
    return n;
}

int32_t ht_tokenizer_vocab(const ht_tokenizer *t) { return t->count; }

int32_t ht_tokenizer_find(const ht_tokenizer *t, const char *token) {
    for (int a = 0; a < t->added_count; a++)
        if (strcmp(t->added[a].content, token) == 0) return t->added[a].id;
    return table_get(&t->vocab, token, strlen(token));
}

/* ------------------------------------------------------------------ loading tokenizer.json */

void ht_tokenizer_free(ht_tokenizer *t) {
    if (!t) return;
    free(t->strings);
    free(t->tokens);
    free(t->token_len);
    free(t->vocab.slots);
    free(t->merges.slots);
    free(t->added);
    free(t);
}

static const char *type_of(const ht_json *j) {
    const ht_json *ty = ht_json_get(j, "type");
    return ty && ty->type == HT_JSON_STRING ? ty->string : "";
}

static bool flag(const ht_json *obj, const char *key) {
    const ht_json *v = ht_json_get(obj, key);
    return v && v->type == HT_JSON_BOOL && v->boolean;
}

/* The pre-tokenizer: ByteLevel with GPT-2's pattern, or Split by Qwen2's or
 * Llama 3's pattern then ByteLevel without one. */
static ht_status read_pre_tokenizer(ht_tokenizer *t, const ht_json *pre, const char *file, ht_error *err) {
    const char *type = type_of(pre);
    if (strcmp(type, "ByteLevel") == 0 && flag(pre, "use_regex")) {
        t->pattern = PATTERN_GPT2;
        t->prefix_space = flag(pre, "add_prefix_space");
        return HT_OK;
    }
    const ht_json *list = ht_json_get(pre, "pretokenizers");
    if (strcmp(type, "Sequence") == 0 && list && list->type == HT_JSON_ARRAY && list->count == 2 &&
        strcmp(type_of(&list->items[0]), "Split") == 0 && strcmp(type_of(&list->items[1]), "ByteLevel") == 0 &&
        !flag(&list->items[1], "use_regex") && !flag(&list->items[0], "invert")) {
        const ht_json *re = ht_json_get(ht_json_get(&list->items[0], "pattern"), "Regex"),
                      *behavior = ht_json_get(&list->items[0], "behavior");
        const char *p = re && re->type == HT_JSON_STRING ? re->string : "";
        bool isolated = behavior && behavior->type == HT_JSON_STRING && strcmp(behavior->string, "Isolated") == 0;
        t->prefix_space = flag(&list->items[1], "add_prefix_space");
        if (isolated && strcmp(p, QWEN2_PATTERN) == 0) return t->pattern = PATTERN_QWEN2, HT_OK;
        if (isolated && strcmp(p, LLAMA3_PATTERN) == 0) return t->pattern = PATTERN_LLAMA3, HT_OK;
        return ht_fail(err, HT_ERR_FORMAT,
                       "%s: the pre-tokenizer splits by %s\"%s\": not one this engine's encoder knows (Qwen2's, "
                       "Llama 3's, GPT-2's); give the prompt as ids (--prompt-ids)",
                       file, isolated ? "" : "a non-Isolated ", p);
    }
    return ht_fail(err, HT_ERR_FORMAT,
                   "%s: pre-tokenizer %s: not a byte-level BPE one this engine's encoder knows (ByteLevel, or Split "
                   "then ByteLevel as Qwen2 and Llama 3 have); give the prompt as ids (--prompt-ids)",
                   file, type[0] ? type : "null");
}

/* The post-processor's special tokens before the sequence (TemplateProcessing's `single`). */
static void read_prefix(ht_tokenizer *t, const ht_json *post) {
    const char *type = type_of(post);
    const ht_json *list = ht_json_get(post, "processors");
    if (strcmp(type, "Sequence") == 0 && list && list->type == HT_JSON_ARRAY) {
        for (size_t i = 0; i < list->count; i++) read_prefix(t, &list->items[i]);
        return;
    }
    const ht_json *single = ht_json_get(post, "single");
    if (strcmp(type, "TemplateProcessing") != 0 || !single || single->type != HT_JSON_ARRAY) return;
    for (size_t i = 0; i < single->count && !ht_json_get(&single->items[i], "Sequence"); i++) {
        const ht_json *sp = ht_json_get(ht_json_get(&single->items[i], "SpecialToken"), "id");
        int32_t id = sp && sp->type == HT_JSON_STRING ? ht_tokenizer_find(t, sp->string) : -1;
        if (id >= 0 && t->prefix_count < (int)(sizeof(t->prefix) / sizeof(t->prefix[0])))
            t->prefix[t->prefix_count++] = id;
    }
}

/* GPT-2's bytes_to_unicode: printable Latin-1 bytes are themselves, the
 * others 256, 257, ... in byte order. */
static void byte_alphabet(ht_tokenizer *t) {
    uint32_t next = 256;
    for (int i = 0; i < 512; i++) t->char_byte[i] = -1;
    for (int b = 0; b < 256; b++) {
        bool printable = (b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE && b <= 0xFF);
        t->byte_char[b] = printable ? (uint32_t)b : next++;
        t->char_byte[t->byte_char[b]] = (int16_t)b;
    }
}

static ht_status read_model(ht_tokenizer *t, const ht_json *root, const char *file, ht_error *err) {
    const ht_json *model = ht_json_get(root, "model"), *vocab = ht_json_get(model, "vocab"),
                  *merges = ht_json_get(model, "merges"), *added = ht_json_get(root, "added_tokens");
    if (strcmp(type_of(model), "BPE") != 0 || !vocab || vocab->type != HT_JSON_OBJECT || !merges ||
        merges->type != HT_JSON_ARRAY)
        return ht_fail(err, HT_ERR_FORMAT, "%s: model %s: not a BPE model with a vocab and merges", file,
                       type_of(model)[0] ? type_of(model) : "(none)");
    if (flag(model, "byte_fallback"))
        return ht_fail(err, HT_ERR_FORMAT, "%s: a byte_fallback BPE (SentencePiece's): not byte-level", file);
    size_t nadded = added && added->type == HT_JSON_ARRAY ? added->count : 0, bytes = 0;
    /* Every string into one block: tokens, added tokens' contents, merge keys "a b". */
    for (size_t i = 0; i < vocab->count; i++) bytes += strlen(vocab->items[i].key) + 1;
    for (size_t i = 0; i < nadded; i++) {
        const ht_json *c = ht_json_get(&added->items[i], "content");
        bytes += c && c->type == HT_JSON_STRING ? strlen(c->string) + 1 : 1;
    }
    for (size_t i = 0; i < merges->count; i++) {
        const ht_json *mg = &merges->items[i];
        if (mg->type == HT_JSON_STRING)
            bytes += strlen(mg->string) + 1;
        else if (mg->type == HT_JSON_ARRAY && mg->count == 2 && mg->items[0].type == HT_JSON_STRING &&
                 mg->items[1].type == HT_JSON_STRING)
            bytes += strlen(mg->items[0].string) + strlen(mg->items[1].string) + 2;
        else
            return ht_fail(err, HT_ERR_FORMAT, "%s: merge %zu is neither \"a b\" nor [a, b]", file, i);
    }
    int64_t top = -1;
    for (size_t i = 0; i < vocab->count; i++)
        top = (int64_t)vocab->items[i].number > top ? (int64_t)vocab->items[i].number : top;
    for (size_t i = 0; i < nadded; i++) {
        const ht_json *id = ht_json_get(&added->items[i], "id");
        if (id && id->type == HT_JSON_NUMBER && id->number > top) top = (int64_t)id->number;
    }
    if (top < 0 || top >= INT32_MAX) return ht_fail(err, HT_ERR_FORMAT, "%s: token ids out of range", file);
    t->count = (int32_t)top + 1;
    t->strings = malloc(bytes + 1);
    t->tokens = calloc((size_t)t->count, sizeof(char *));
    t->token_len = calloc((size_t)t->count, sizeof(uint32_t));
    t->added = calloc(nadded + 1, sizeof(added_token));
    if (!t->strings || !t->tokens || !t->token_len || !t->added || !table_init(&t->vocab, vocab->count + nadded) ||
        !table_init(&t->merges, merges->count))
        return ht_fail(err, HT_ERR_OOM, "%s: out of memory for %d tokens", file, t->count);
    char *at = t->strings;
    for (size_t i = 0; i < vocab->count + nadded; i++) {
        const bool is_added = i >= vocab->count;
        const ht_json *item = is_added ? &added->items[i - vocab->count] : &vocab->items[i];
        const ht_json *id = is_added ? ht_json_get(item, "id") : item, *c = ht_json_get(item, "content");
        const char *text = is_added ? (c && c->type == HT_JSON_STRING ? c->string : NULL) : item->key;
        if (!text || !id || id->type != HT_JSON_NUMBER || id->number < 0)
            return ht_fail(err, HT_ERR_FORMAT, "%s: %s %zu has no id or content", file,
                           is_added ? "added token" : "vocab entry", is_added ? i - vocab->count : i);
        size_t len = strlen(text);
        memcpy(at, text, len + 1);
        const int32_t v = (int32_t)id->number;
        t->tokens[v] = at, t->token_len[v] = (uint32_t)len;
        if (is_added) t->added[t->added_count++] = (added_token){at, len, v};
        slot *sl = table_slot(&t->vocab, at, len);
        if (!sl->key) *sl = (slot){at, (uint32_t)len, v};
        at += len + 1;
    }
    for (size_t i = 0; i < merges->count; i++) {
        const ht_json *mg = &merges->items[i];
        size_t len = mg->type == HT_JSON_STRING
                         ? (size_t)sprintf(at, "%s", mg->string)
                         : (size_t)sprintf(at, "%s %s", mg->items[0].string, mg->items[1].string);
        slot *sl = table_slot(&t->merges, at, len);
        if (!sl->key) *sl = (slot){at, (uint32_t)len, (int32_t)i};
        at += len + 1;
    }
    t->ignore_merges = flag(model, "ignore_merges");
    return HT_OK;
}

ht_status ht_tokenizer_load(const char *path, ht_tokenizer **out, ht_error *err) {
    *out = NULL;
    char file[4096];
    int vocab; /* the path as ht_tokenizer_vocab_size reads it: a tokenizer.json or a folder holding one */
    ht_status s = ht_tokenizer_vocab_size(path, &vocab, file, sizeof(file), err);
    if (s != HT_OK) return s;
    ht_json *root;
    if ((s = ht_json_read_file(file, "a tokenizer.json", &root, err)) != HT_OK) return s;
    ht_tokenizer *t = calloc(1, sizeof(ht_tokenizer));
    if (!t) s = ht_fail(err, HT_ERR_OOM, "tokenizer: out of memory");
    const ht_json *norm = ht_json_get(root, "normalizer");
    const char *nt = type_of(norm);
    /* NFC leaves text that is NFC already (nearly all typed text) as it is: taken as the identity here. */
    if (s == HT_OK && norm && norm->type != HT_JSON_NULL && strcmp(nt, "NFC") != 0)
        s = ht_fail(err, HT_ERR_FORMAT, "%s: normalizer %s: not supported (none, or NFC)", file, nt[0] ? nt : "?");
    if (s == HT_OK) s = read_model(t, root, file, err);
    if (s == HT_OK) s = read_pre_tokenizer(t, ht_json_get(root, "pre_tokenizer"), file, err);
    if (s == HT_OK) {
        byte_alphabet(t);
        read_prefix(t, ht_json_get(root, "post_processor"));
    }
    ht_json_free(root);
    if (s != HT_OK) {
        ht_tokenizer_free(t);
        return s;
    }
    *out = t;
    return HT_OK;
}
