"""Rules every step process follows: its kind and name, its exit codes, retry backoff, watchdogs; and the ports
and HTTP listeners of the servers rlpipe runs (`ports`, `listener`)."""
