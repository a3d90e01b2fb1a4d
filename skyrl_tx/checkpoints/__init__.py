"""Checkpoints: tinker:// paths, the storage they live in (local or fsspec), and their file formats."""
