"""MiniCPM-V web demo: a Gradio UI over one process-wide model manager."""
