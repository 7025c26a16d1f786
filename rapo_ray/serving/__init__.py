"""Serving the trained agent: an OpenAI-compatible Ray Serve app that runs the tool loop (``app.py``)."""
