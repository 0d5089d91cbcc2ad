"""Data scripts for the trainer: download, build, tokenize and check `.bin` token shards (see data/README.md)."""
