/* `hypertrain launch` (launch.c): a training command run under a launcher
 * that turns a scheduler's signal into a stop checkpoint. */
#ifndef HT_CLI_LAUNCH_H
#define HT_CLI_LAUNCH_H

/* argv: [--grace SECONDS] -- COMMAND [ARGS...]; the exit status. */
int cmd_launch(int argc, char **argv);

#endif
