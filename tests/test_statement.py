"""The problem statement's test cases and its __main__ block, verbatim."""

import numpy as np

from spmd import Communicator, compute_fn, dp_mat_mul, fsdp_mat_mul


def test_statement_cases():
    # Test 1: Basic 2-device DP
    np.random.seed(42)
    a = np.random.randn(8, 6)
    b = np.random.randn(6, 4)
    assert np.allclose(dp_mat_mul(a, b, 2), a @ b)

    # Test 2: Basic 2-device FSDP
    assert np.allclose(fsdp_mat_mul(a, b, 2), a @ b)

    # Test 3: 4-device DP
    a = np.random.randn(16, 8)
    b = np.random.randn(8, 12)
    assert np.allclose(dp_mat_mul(a, b, 4), a @ b)

    # Test 4: 4-device FSDP
    assert np.allclose(fsdp_mat_mul(a, b, 4), a @ b)

    # Test 5: Single device (degenerate case)
    a = np.random.randn(4, 3)
    b = np.random.randn(3, 5)
    assert np.allclose(dp_mat_mul(a, b, 1), a @ b)
    assert np.allclose(fsdp_mat_mul(a, b, 1), a @ b)


def test_statement_main_block(capsys):
    np.random.seed(42)
    M, K, N, num_devices = 8, 6, 4, 2
    a = np.random.randn(M, K)
    b = np.random.randn(K, N)
    expected = a @ b

    result_dp = dp_mat_mul(a, b, num_devices)
    assert np.allclose(result_dp, expected), "DP result mismatch!"
    print("DP passed!")

    result_fsdp = fsdp_mat_mul(a, b, num_devices)
    assert np.allclose(result_fsdp, expected), "FSDP result mismatch!"
    print("FSDP passed!")
    assert capsys.readouterr().out == "DP passed!\nFSDP passed!\n"


def test_statement_starter_driver_works_with_our_compute_fn():
    """The statement's own dp_mat_mul body (threads + Communicator + compute_fn) works."""
    import threading

    np.random.seed(7)
    a, b, num_devices = np.random.randn(9, 5), np.random.randn(5, 4), 3
    comm = Communicator(num_devices)
    result = [None]
    a_chunks = np.array_split(a, num_devices, axis=0)
    threads = [
        threading.Thread(target=compute_fn, args=(comm, rank, a_chunks[rank], b, result)) for rank in range(num_devices)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert comm.num_devices == num_devices
    assert np.allclose(result[0], a @ b)


def test_the_threads_path_never_initializes_mpi():
    """Importing mpi4py.MPI initializes MPI: the statement's API and the threads CLI must not."""
    import subprocess
    import sys

    code = (
        "import sys, numpy as np, spmd\n"
        "from spmd import dp_mat_mul, fsdp_mat_mul, run_threads, MPICommunicator, run_mpi\n"
        "a, b = np.ones((4, 3)), np.ones((3, 2))\n"
        "assert (fsdp_mat_mul(a, b, 2) == 3).all() and (dp_mat_mul(a, b, 2) == 3).all()\n"
        "from spmd.harness.cli import main\n"
        "assert main(['fsdp', '--devices', '2', '--m', '8', '--k', '4', '--n', '4', '--check']) == 0\n"
        "assert 'mpi4py.MPI' not in sys.modules, 'mpi4py.MPI was imported'\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
