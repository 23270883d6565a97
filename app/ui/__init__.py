"""The Gradio UI: plain handler functions (handlers.py) and the Blocks layout that wires them (layout.py)."""
