"""Jinja instantiation templates and the C++ kernel headers, shipped as package data (gemmgen.templates)."""
