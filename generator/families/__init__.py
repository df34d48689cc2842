"""Kernel families: each module declares one instance space, its validity rule and its template."""
