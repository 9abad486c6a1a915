"""The run root: its paths (`layout`), the commit protocol (`storage`, `committed`), leases, waiting for files
(`poll`, woken by `notify`), reading ahead (`prefetch`), what the run root says about progress (`run_state`) and
the staleness rule (`staleness`)."""
