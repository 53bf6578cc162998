"""The query language: the IR and its builder, spnl-compatible JSON, the typed errors, and the
flattening of a query into ordinary chat messages.
"""
