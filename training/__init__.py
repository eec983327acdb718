"""Training the embedded model pair on real text (issue 9)."""
