"""Datasets, tokenization, packing and the distributed loader."""
