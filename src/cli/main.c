/* The hypertrain command: train, export, inspect, plot. Only this file calls exit(). */
#include <stdio.h>
#include <string.h>

#include "hypertrain/base.h"

int main(int argc, char **argv) {
    if (argc < 2 || strcmp(argv[1], "--help") == 0) {
        fprintf(stderr, "usage: hypertrain train CONFIG.yaml [--set key=value ...]\n");
        return argc < 2 ? 2 : 0;
    }
    fprintf(stderr, "hypertrain: unknown command '%s'\n", argv[1]);
    return 2;
}
