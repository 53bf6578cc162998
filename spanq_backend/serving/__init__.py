"""Serving span queries on vLLM: lowering to tokens and a span table, span-aware generation, the
embedded engine, `spanq serve`, and the model folders.
"""
