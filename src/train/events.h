/* TensorBoard's event files (src/train/events.c): what the trainer writes
 * for training.tensorboard, and what the tests read back. */
#ifndef HT_TRAIN_EVENTS_H
#define HT_TRAIN_EVENTS_H

#include <stdio.h>

#include "hypertrain/base.h"

/* One events.out.tfevents.* file, appended record by record. An event holds
 * one step's scalars: ht_events_begin, ht_events_scalar for each, then
 * ht_events_end frames it (buffered until ht_events_flush). */
typedef struct ht_events {
    FILE *f;
    char path[4096];
    unsigned char *summary; /* the open event's Summary message, as built */
    size_t len, cap;
    int64_t step;     /* the open event's */
    bool out_of_room; /* an allocation failed: the error is ht_events_end's */
} ht_events;

/* Creates dir (and its parents) and a new event file in it, named
 * events.out.tfevents.<seconds>.<host>.<pid> (TensorBoard reads the files of a
 * directory in name order), never through a link, and writes its first
 * record (file_version "brain.Event:2"). first_step > 1 (a resumed run): a
 * SessionLog START at that step follows, which tells TensorBoard's reader to
 * drop what the earlier files hold from that step on (a run that went past
 * its last checkpoint before it stopped). */
ht_status ht_events_open(ht_events *w, const char *dir, int64_t first_step, ht_error *err);
void ht_events_begin(ht_events *w, int64_t step);
/* A scalar of the open event (a summary value: tag, simple_value as float);
 * a non-finite value is left out, as metrics.jsonl writes null. */
void ht_events_scalar(ht_events *w, const char *tag, double value);
/* Frames the open event as a record (TFRecord: length, masked CRC-32C of the
 * length, the Event, masked CRC-32C of the Event). An event with no values is
 * not written. */
ht_status ht_events_end(ht_events *w, ht_error *err);
/* What was written reaches the file (not the disk): an error names the file. */
ht_status ht_events_flush(ht_events *w, ht_error *err);
/* Flushed, synced and closed (an error names the file); then nothing is open. */
ht_status ht_events_close(ht_events *w, ht_error *err);

/* TFRecord's masked CRC-32C of n bytes (rotated 15 bits right plus 0xa282ead8). */
uint32_t ht_events_masked_crc(const void *data, size_t n);

#endif
