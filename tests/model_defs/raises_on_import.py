"""A model definition that fails while being imported."""

raise RuntimeError("cannot find my weights file")
