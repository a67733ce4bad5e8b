"""Built-in detector architectures besides the default (pfactory/model)."""
