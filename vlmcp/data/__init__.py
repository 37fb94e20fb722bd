"""Data path: JSONL lines -> samples -> packed micro-batches."""
