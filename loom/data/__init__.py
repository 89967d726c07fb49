"""Data: sources, tokenizers, documents, mixing, SFT examples, streaming, prepared shards, and the
run's datasets in one place (run_data.build_run_data)."""
