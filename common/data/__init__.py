"""Data: the formats we read, generated data, partitions into hospitals, and a consortium's own loaders."""
