"""The model: build from a config, FLOP and parameter figures."""
