"""Packed token data for training: the loader, the source mixture, the joined map."""
