"""Finding, loading, quantizing and building checkpoints."""
