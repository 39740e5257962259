"""This machine's roofline and each engine step against it (python -m ops.roofline)."""
