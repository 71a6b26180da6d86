/* The layering the build enforces (tests/layers.sh): each folder compiles
 * with only the include paths it may use, so every wrong-way include fails,
 * every allowed one works, and no object uses a symbol of a layer above it. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>

#include "testutil.h"

Test(layers, every_include_and_symbol_follows_the_dependency_graph) {
    FILE *p = popen("bash tests/layers.sh 2>&1", "r");
    cr_assert_not_null(p, "cannot run tests/layers.sh");
    char out[16384];
    size_t n = fread(out, 1, sizeof out - 1, p);
    out[n] = 0;
    int st = pclose(p);
    cr_assert(WIFEXITED(st) && WEXITSTATUS(st) == 0, "tests/layers.sh failed:\n%s", out);
    cr_log_info("%s", out);
}
