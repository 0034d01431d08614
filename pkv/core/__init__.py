"""The data model every other role builds on: shapes, traces, continuous batching, page assignment, the paged KV
cache (16-bit and FP8), input validation and the Parquet/provenance I/O. Torch loads only where a tensor is made."""
