"""streambatch worker: the engine and (later) the Redis service around it."""
