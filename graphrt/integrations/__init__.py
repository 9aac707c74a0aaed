"""Adapters that run model libraries' own modeling code on the graphrt runtime."""
