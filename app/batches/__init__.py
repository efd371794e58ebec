"""The Batch API (issue 37): batches of requests from a tenant's JSONL file, validated whole before any line
runs; their lines wait in the database for the runner."""
