"""Checkpoint folders: format, save, verify, read, resume, reuse."""
