"""The `kugetsu` command line (entry point: main.run)."""
