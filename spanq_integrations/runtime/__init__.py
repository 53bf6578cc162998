"""Running span queries: the backend protocol, the async executor, judges and their reducers, and the
one bridge from synchronous code to the event loop.
"""
