"""Where the queue lives: the store protocol and its two stores (files: index.json and
events.jsonl under a kernel lock; postgres: cluster mode), and bounded reading of logs."""
