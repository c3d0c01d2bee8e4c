"""config.json: units (durations, sizes), the model (keys, defaults, presets), loading and
saving (with a cluster's shared config), explaining an invalid value, dotted keys."""
