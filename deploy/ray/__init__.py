"""The Ray backend: the supervisor with each replica in a placement group on a Ray cluster."""
