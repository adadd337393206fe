#!/usr/bin/env bash
# After a failed ctest run: each failed test's failures again, at the end of
# the log, where a reader of its tail (CI's summary) sees them: the lines
# cmocka prints for a failure (the message, "[  ERROR   ]" with file and
# line, "[  FAILED  ]") and the few lines before each, from the build
# folder's Testing/Temporary/LastTest.log. Usage: scripts/ctest-failures.sh BUILD_DIR
set -euo pipefail
log="${1:?usage: $0 BUILD_DIR}/Testing/Temporary/LastTest.log"
[ -r "$log" ] || { echo "ctest-failures: no $log" >&2; exit 0; }
awk '
    /^[0-9]+\/[0-9]+ Testing: / { name = $3; n = 0; next }
    /^<end of output>$/ { ended = 1; next }
    /^Output:$/ { ended = 0; next }
    !ended && name != "" { out[n++] = $0 }
    /^Test Failed\./ {
        printf "\n== %s failed; its failures (of %d lines of output):\n", name, n
        shown = 0
        for (i = 0; i < n && shown < 60; i++) {
            if (out[i] !~ /\[  ERROR   \]|\[  FAILED  \]|^ERROR: |error: |Test failed with exception/) continue
            for (j = (i >= 3 ? i - 3 : 0); j <= i; j++)
                if (!(j in printed)) { print "   " substr(out[j], 1, 400); printed[j] = 1; shown++ }
        }
        if (shown == 0) for (i = (n > 25 ? n - 25 : 0); i < n; i++) print "   " substr(out[i], 1, 400)
        delete printed
        name = ""
    }
' "$log"
