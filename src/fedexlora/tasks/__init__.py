"""Tasks: embedded and local data, hub loaders, partitioners, metrics, NLG metrics."""
