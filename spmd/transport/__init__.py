"""How messages move: the Communicator on threads or MPI, wire format, traffic, groups and the mesh."""
