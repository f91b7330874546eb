"""A corridor to walk to its end: a plugin as a third party wrote it for LlamaGym 0.3."""
