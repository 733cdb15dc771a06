"""The typed config: schema, types, files, presets, ``python -m pipeline.config``."""
