"""Decode worker: reserves KV blocks, receives prefilled KV and streams generated tokens."""
