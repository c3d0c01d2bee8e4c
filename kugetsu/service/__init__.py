"""The long-running service: the daemon (its loop and executor), the agents' processes, exit
watching, the process helpers (runner), deadlines, the git worktree worker, the usage sampler."""
