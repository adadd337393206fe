/* The text_bytes dataset: a text file, or the text files of one folder, as a
 * stream of bytes (vocab 256). A folder is read flat, in byte order of the
 * file names; symlinks and subfolders are skipped (Debian's fortunes folder
 * has a .u8 symlink beside every file), and so are files with a NUL byte,
 * which are binary (the fortunes .dat indexes). */
#include "hypertrain/data.h"

#include <dirent.h>
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

static int compare_names(const void *a, const void *b) {
    return strcmp(*(const char *const *)a, *(const char *const *)b);
}

static void free_names(char **names, size_t n) {
    for (size_t i = 0; i < n; i++) free(names[i]);
    free(names);
}

/* The sorted names of the entries of `dir`, without "." and "..". */
static ht_status list_folder(const char *dir, char ***out, size_t *out_n, ht_error *err) {
    DIR *d = opendir(dir);
    if (!d) return ht_fail(err, HT_ERR_IO, "data.path %s: cannot open the folder: %s", dir, strerror(errno));
    char **names = NULL;
    size_t n = 0, cap = 0;
    struct dirent *e;
    while ((e = readdir(d)) != NULL) {
        if (strcmp(e->d_name, ".") == 0 || strcmp(e->d_name, "..") == 0) continue;
        if (n == cap) {
            cap = cap ? 2 * cap : 64;
            char **grown = realloc(names, cap * sizeof(*names));
            if (!grown) break;
            names = grown;
        }
        if (!(names[n] = strdup(e->d_name))) break;
        n++;
    }
    bool failed = e != NULL;
    closedir(d);
    if (failed) {
        free_names(names, n);
        return ht_fail(err, HT_ERR_OOM, "data.path %s: out of memory listing the folder", dir);
    }
    if (n) qsort(names, n, sizeof(*names), compare_names);
    *out = names;
    *out_n = n;
    return HT_OK;
}

/* Appends the bytes of `path` to ds->tokens as a new source. */
static ht_status append_bytes(ht_dataset *ds, const char *path, const char *bytes, size_t size, ht_error *err) {
    uint32_t *grown = realloc(ds->tokens, (ds->n_tokens + size + 1) * sizeof(*grown));
    if (!grown) return ht_fail(err, HT_ERR_OOM, "%s: cannot allocate %zu tokens", path, ds->n_tokens + size);
    ds->tokens = grown;
    for (size_t i = 0; i < size; i++) ds->tokens[ds->n_tokens + i] = (unsigned char)bytes[i];
    ds->n_tokens += size;
    return ht_dataset_add_source(ds, path, size, err);
}

/* A text file whole: its bytes and their 4-byte tokens must fit in memory
 * together, which its size tells before a byte is read. */
static ht_status read_text(const char *path, char **bytes, size_t *size, ht_error *err) {
    return ht_read_file_max(path, ht_physical_memory() / 5,
                            "a text_bytes file may have on this machine (1 + 4 bytes of memory per byte: the text and "
                            "its tokens)",
                            bytes, size, err);
}

static ht_status open_folder(const char *dir, ht_dataset *ds, ht_error *err) {
    char **names = NULL;
    size_t n = 0;
    ht_status st = list_folder(dir, &names, &n, err);
    if (st != HT_OK) return st;
    int binary = 0, links = 0, folders = 0;
    char path[2048];
    for (size_t i = 0; i < n && st == HT_OK; i++) {
        snprintf(path, sizeof(path), "%s/%s", dir, names[i]);
        struct stat sb;
        if (lstat(path, &sb) != 0) {
            st = ht_fail(err, HT_ERR_IO, "%s: cannot stat: %s", path, strerror(errno));
            break;
        }
        if (S_ISLNK(sb.st_mode))
            links++;
        else if (S_ISDIR(sb.st_mode))
            folders++;
        if (!S_ISREG(sb.st_mode)) continue;
        char *bytes;
        size_t size;
        st = read_text(path, &bytes, &size, err);
        if (st != HT_OK) break;
        if (memchr(bytes, '\0', size))
            binary++;
        else
            st = append_bytes(ds, path, bytes, size, err);
        free(bytes);
    }
    free_names(names, n);
    if (st != HT_OK) return st;
    if (ds->n_sources == 0)
        return ht_fail(err, HT_ERR_CONFIG, "data.path %s: the folder has no text files (%d binary skipped)", dir,
                       binary);
    ht_log_info("data: text_bytes %s: %d text files; skipped %d binary (with a NUL byte), %d symlinks, %d subfolders",
                dir, ds->n_sources, binary, links, folders);
    return HT_OK;
}

ht_status ht_dataset_open_text_bytes(const ht_data_config *cfg, ht_dataset *ds, ht_error *err) {
    ds->vocab_size = 256;
    struct stat sb;
    if (stat(cfg->path, &sb) != 0)
        return ht_fail(err, HT_ERR_IO, "data.path %s: cannot open: %s", cfg->path, strerror(errno));
    if (S_ISDIR(sb.st_mode)) return open_folder(cfg->path, ds, err);
    char *bytes;
    size_t size;
    ht_status st = read_text(cfg->path, &bytes, &size, err);
    if (st != HT_OK) return st;
    const char *nul = memchr(bytes, '\0', size);
    if (nul)
        st = ht_fail(err, HT_ERR_FORMAT,
                     "%s: a NUL byte at offset %zu: not a text file (token shards are dataset_type token_bin)",
                     cfg->path, (size_t)(nul - bytes));
    else
        st = append_bytes(ds, cfg->path, bytes, size, err);
    free(bytes);
    return st;
}
