"""Rules every step process follows: its kind and name, its exit codes, retry backoff, watchdogs."""
