"""Everything that touches the model: checkpoint resolution, loading, and the model manager. No Gradio here."""
