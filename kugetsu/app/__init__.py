"""The application layer: the transactions every front end shares (ops), waiting for tasks,
starting and waking the service (control), the history a window of time reads (stats)."""
