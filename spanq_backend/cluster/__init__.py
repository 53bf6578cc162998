"""Beyond one engine, on Ray (the `cluster` extra): span-affinity routing across `spanq serve` replicas on Ray
Serve (`app`, `routing`) and bulk span queries over a pool of span engines on Ray Data (`bulk`).

Nothing outside this package imports Ray; importing the package itself does not either.
"""
