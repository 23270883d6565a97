"""The web side: Gradio's server, the web processes and their proxy, uploads, the login. Never imports torch."""
