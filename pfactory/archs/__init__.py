"""Built-in detector architectures besides the default (pfactory/archs/painted_pillars)."""
