"""The benchmark: numpy against each strategy and collective, on threads and MPI."""
