"""Load generator and SLO report for a live or private deployment (python -m ops.load)."""
