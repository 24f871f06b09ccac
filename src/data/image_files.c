// image_files.c: the image files named on a command line or found under folders: folders are walked
// depth first in name order (the listing is the same on every file system), hidden entries left
// out, .jpg/.jpeg/.png/.webp kept (src/data/image.h). Used by every command that reads image
// files and by fine-tuning's image folders (src/train/finetune_task.c). Covered by
// tests/test_classify_embed.c and tests/test_finetune.c.
#include <dirent.h>
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/stat.h>

#include "core/core.h"
#include "data/image.h"
#include "data/readers.h"

typedef struct {
    char **v;
    int n, cap;
} path_list;

static int push(path_list *l, const char *path) {
    if (l->n == l->cap) {
        const int cap = l->cap ? 2 * l->cap : 256;
        char **v = realloc(l->v, sizeof(char *) * (size_t)cap);
        if (!v) return vlmoe_fail(VLMOE_ERR_NOMEM, "out of memory listing image files");
        l->v = v, l->cap = cap;
    }
    if (!(l->v[l->n] = strdup(path))) return vlmoe_fail(VLMOE_ERR_NOMEM, "out of memory listing image files");
    l->n++;
    return VLMOE_OK;
}

static int is_image_name(const char *name) {
    static const char *const EXT[] = {".jpg", ".jpeg", ".png", ".webp"};
    const size_t n = strlen(name);
    for (size_t i = 0; i < sizeof(EXT) / sizeof(EXT[0]); i++) {
        const size_t k = strlen(EXT[i]);
        if (n > k && !strcasecmp(name + n - k, EXT[i])) return 1;
    }
    return 0;
}

static int by_name(const struct dirent **a, const struct dirent **b) { return strcmp((*a)->d_name, (*b)->d_name); }

// The folders on the path from the walk's root to the one being listed: a folder reached again
// through a symbolic link (the same device and inode as one above it) is a loop, which the
// depth bound alone stops only after 2^64 listings when a folder links to its parent twice.
typedef struct ancestor { dev_t dev; ino_t ino; const char *path; const struct ancestor *up; } ancestor;

static int walk(const char *dir, path_list *l, int depth, const ancestor *up) {
    struct stat ds;
    if (stat(dir, &ds) != 0) return vlmoe_fail(VLMOE_ERR_IO, "%s: %s", dir, strerror(errno));
    for (const ancestor *a = up; a; a = a->up)
        if (a->dev == ds.st_dev && a->ino == ds.st_ino)
            return vlmoe_fail(VLMOE_ERR_ARG, "%s: a symbolic link loop: this folder is %s again", dir, a->path);
    if (depth > 64) return vlmoe_fail(VLMOE_ERR_ARG, "%s: folders nested more than 64 deep", dir);
    const ancestor me = {ds.st_dev, ds.st_ino, dir, up};
    struct dirent **ents;
    const int ne = scandir(dir, &ents, NULL, by_name);
    if (ne < 0) return vlmoe_fail(VLMOE_ERR_IO, "%s: %s", dir, strerror(errno));
    int st = VLMOE_OK;
    const size_t dl = strlen(dir);
    for (int i = 0; i < ne; i++) {
        const char *name = ents[i]->d_name;
        if (!st && name[0] != '.') {
            char *p = malloc(dl + strlen(name) + 2);
            struct stat sb;
            if (!p) {
                st = vlmoe_fail(VLMOE_ERR_NOMEM, "out of memory listing %s", dir);
            } else {
                sprintf(p, "%s%s%s", dir, dl && dir[dl - 1] == '/' ? "" : "/", name);
                if (stat(p, &sb) == 0 && S_ISDIR(sb.st_mode)) st = walk(p, l, depth + 1, &me);
                else if (is_image_name(name)) st = push(l, p);
                free(p);
            }
        }
        free(ents[i]);
    }
    free(ents);
    return st;
}

int vlmoe_list_images(const char *const *args, int nargs, char ***out, int *n) {
    path_list l = {0};
    int st = VLMOE_OK;
    for (int a = 0; a < nargs && !st; a++) {
        struct stat sb;
        if (stat(args[a], &sb) == 0 && S_ISDIR(sb.st_mode)) {
            const int before = l.n;
            st = walk(args[a], &l, 0, NULL);
            if (!st && l.n == before)
                st = vlmoe_fail(VLMOE_ERR_ARG, "%s: a folder without image files (.jpg, .jpeg, .png, .webp)", args[a]);
        } else {
            st = push(&l, args[a]);
        }
    }
    if (st) {
        vlmoe_free_strings(l.v, l.n);
        return st;
    }
    *out = l.v, *n = l.n;
    return VLMOE_OK;
}
