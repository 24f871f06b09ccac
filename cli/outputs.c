// outputs.c: outputs never overwrite inputs (cli/outputs.h). Paths are compared by what they name
// on disk, not by spelling. Covered by tests/hostile/test_hostile_files.c.
#include "outputs.h"

#include <errno.h>
#include <stdio.h>
#include <string.h>
#include <sys/stat.h>

#include "cli.h"

// Where a path points: the file itself when it exists (links followed); else its folder and its
// last component. 0 when neither can be found out (the command's own open will say why).
typedef struct {
    int exists;
    dev_t dev;
    ino_t ino;
    const char *name; // the last component, for a path that does not exist
} file_id;

static int identify(const char *path, file_id *id) {
    struct stat sb;
    memset(id, 0, sizeof(*id));
    if (!stat(path, &sb)) {
        id->exists = 1, id->dev = sb.st_dev, id->ino = sb.st_ino;
        return 1;
    }
    if (errno != ENOENT) return 0;
    char dir[4096];
    const char *slash = strrchr(path, '/');
    id->name = slash ? slash + 1 : path;
    if (!slash) snprintf(dir, sizeof(dir), ".");
    else if (slash == path) snprintf(dir, sizeof(dir), "/");
    else if (snprintf(dir, sizeof(dir), "%.*s", (int)(slash - path), path) >= (int)sizeof(dir)) return 0;
    if (stat(dir, &sb)) return 0;
    id->dev = sb.st_dev, id->ino = sb.st_ino;
    return *id->name != 0;
}

static int same(const file_id *a, const file_id *b) {
    if (a->exists != b->exists || a->dev != b->dev || a->ino != b->ino) return 0;
    return a->exists || !strcmp(a->name, b->name);
}

int cli_check_output(const char *cmd, const char *oflag, const char *out, const cli_input *in, int n) {
    file_id o, x;
    if (!out || !identify(out, &o)) return 0;
    for (int i = 0; i < n; i++)
        if (in[i].path && identify(in[i].path, &x) && same(&o, &x))
            return cli_error(cmd, "%s %s is the same file as %s %s: writing it would destroy an input of this "
                             "command; choose another output file", oflag, out, in[i].flag, in[i].path);
    return 0;
}

int cli_check_run_outputs(const char *cmd, const char *dir, const cli_input *in, int n) {
    static const char *const files[] = {"config.json", "params.json", "params_resumed.json", "metrics.jsonl",
                                        "metrics.dropped.jsonl"};
    char path[4200];
    for (int i = 0; i < (int)(sizeof(files) / sizeof(files[0])); i++) {
        snprintf(path, sizeof(path), "%s/%s", dir, files[i]);
        if (cli_check_output(cmd, "the run's file", path, in, n)) return 1;
    }
    return 0;
}
