"""Data sets: sources -> prepared Parquet dataset directory -> Ray Data / torch tensors."""
