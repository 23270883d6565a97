"""Turning uploads into model inputs: image loading, the visual-token budget, video sampling."""
