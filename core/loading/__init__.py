"""From flags to a checkpoint a model can load: opening a folder, a file or the hub cache, and random
weights shaped by a model family (`--load-format dummy`)."""
