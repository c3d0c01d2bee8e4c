"""The pure core: every scheduling rule as functions of an Index, a Config and a clock (no I/O).

models (the index and its tasks), pm (admission, transitions, the service's step), policy (who
starts next), limits, placement, budgets, schedules. Nothing here imports a store, a process
or a front end (docs/architecture.md).
"""
