"""Parallelism applied to a single-device model from outside: Ulysses sequence groups, expert
sharding over the expert group (the model itself knows nothing of process groups)."""
