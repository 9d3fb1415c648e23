"""Benchmarks of the batchgen engine and its Hugging Face transformers peers (run with python -m benchmarks.NAME)."""
