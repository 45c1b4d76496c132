"""Input formats: how files become columns of raw values (one module per format)."""
