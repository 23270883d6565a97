"""One-off investigations: each measured one part or a setting that was tried; their runs are in benchmarks/LOG.md."""
