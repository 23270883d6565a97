"""The GPU side: the batch runner, the fused text model and vision tower, sampling, checkpoints."""
