"""What steps measure about themselves: metrics records under the run root (`metrics`) and the per-hop timing
of a learner step (`hops`)."""
