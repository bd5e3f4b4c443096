"""The byte format: the packed layout, per-bucket digests, sharded pieces, sliced runs (private)."""
