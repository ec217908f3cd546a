"""The Communicator interface both backends implement, and the rules they share.

The interface is the problem statement's: `send(src, dst, data)` and
`recv(dst) -> (src, data)`, with optional matching on top: a message carries a
`tag`, and `recv` can ask for a given source and/or tag (like MPI), so two
protocols in flight at once never take each other's messages. Between one
sender and one receiver, messages with the same tag arrive in the order sent.
"""

import abc
from contextlib import contextmanager
from traceback import format_exception

import numpy as np

from spmd.transport.clock import Tracer, now_us
from spmd.transport.traffic import Traffic

ANY = -1  # recv wildcard for `src` or `tag` (MPI's ANY_SOURCE / ANY_TAG)
MAX_TAG = 32767  # the largest tag every MPI implementation must accept
DEFAULT_TIMEOUT = 300.0  # seconds one recv may wait: generous, but never forever

# Array kinds a message may carry: bool, signed, unsigned, float, complex.
# Object arrays would need pickling, which this project never does.
PAYLOAD_KINDS = "biufc"


class CommError(RuntimeError):
    """A message could not be sent or received as asked."""


class Aborted(CommError):
    """Raised in a rank that waits for a message after another rank failed."""


class DeadlockError(CommError):
    """Every rank still running waits for something (a message, a receive) no rank will do."""


class CommTimeout(CommError):
    """A wait (recv, or a request's wait) lasted longer than the communicator's timeout."""


class RankFailure(RuntimeError):
    """A rank function raised; `rank` says which, `__cause__` holds its error."""

    def __init__(self, rank: int, error: BaseException):
        super().__init__(f"rank {rank} failed: {type(error).__name__}: {error}")
        self.rank = rank


def describe_wait(src: int, tag: int) -> str:
    """'from rank 1 (tag 2)', 'from any rank (any tag)': what a recv waits for."""
    who = "any rank" if src == ANY else f"rank {src}"
    return f"from {who} ({'any tag' if tag == ANY else f'tag {tag}'})"


def failure_message(rank: int, num_devices: int, error: BaseException, traceback: bool = True) -> str:
    """What a launcher prints when a rank fails: which rank, the error, and (unless traceback=False, as the
    command line prints it by default) its Python traceback."""
    line = f"spmd: rank {rank} of {num_devices} failed: {type(error).__name__}: {error}\n"
    if not traceback:
        return line + "  (run with --debug or SPMD_DEBUG=1 for the traceback)\n"
    return line + "".join(format_exception(error))


def is_numeric(dtype: np.dtype) -> bool:
    """True for the dtypes a message or an input matrix may have."""
    return dtype.kind in PAYLOAD_KINDS and dtype.fields is None


def numeric_array(data) -> np.ndarray:
    """`data` as an array (no copy where possible); TypeError unless it holds numbers."""
    array = np.asarray(data)
    if not is_numeric(array.dtype):
        raise TypeError(f"a message carries numeric arrays only (bool, int, float, complex); got dtype {array.dtype}")
    return array


def as_payload(data) -> np.ndarray:
    """Return a private C-contiguous copy of `data`, the value a message carries.

    The copy gives queue semantics: once `send` returns, the sender may reuse
    its buffer without changing what the receiver gets.
    """
    return np.array(numeric_array(data), order="C", copy=True)


def check_rank(role: str, value, num_devices: int) -> None:
    """Raise ValueError unless `value` is a rank of a world of `num_devices`."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{role} must be an int rank, got {value!r}")
    if not 0 <= value < num_devices:
        raise ValueError(f"{role} rank {value} is outside 0..{num_devices - 1}")


def check_tag(tag, allow_any: bool) -> None:
    """Raise ValueError unless `tag` is a valid message tag (or ANY, where allowed)."""
    if allow_any and tag == ANY:
        return
    if isinstance(tag, bool) or not isinstance(tag, (int, np.integer)):
        raise TypeError(f"tag must be an int, got {tag!r}")
    if not 0 <= tag <= MAX_TAG:
        raise ValueError(f"tag {tag} is outside 0..{MAX_TAG}")


def check_num_devices(num_devices) -> None:
    """Raise unless `num_devices` is an int >= 1."""
    if isinstance(num_devices, bool) or not isinstance(num_devices, (int, np.integer)):
        raise TypeError(f"num_devices must be an int, got {num_devices!r}")
    if num_devices < 1:
        raise ValueError(f"num_devices must be >= 1, got {num_devices}")


def check_message(dst: int, src: int, tag: int, got: tuple, out: np.ndarray) -> None:
    """CommError naming both ranks unless a message of (dtype, shape) `got` fits `out`."""
    dtype, shape = got
    if dtype != out.dtype or tuple(shape) != out.shape:
        raise CommError(
            f"rank {dst} expected {out.dtype} {out.shape} from rank {src} (tag {tag}), got {dtype} {tuple(shape)}"
        )


def check_out(out: np.ndarray) -> None:
    """ValueError unless `out` can be received into in place."""
    if not isinstance(out, np.ndarray) or not out.flags.c_contiguous or not out.flags.writeable:
        raise ValueError("irecv needs `out`, a writeable C-contiguous numpy array")


class Request(abc.ABC):
    """A non-blocking send or receive in progress."""

    @abc.abstractmethod
    def test(self) -> bool:
        """True once the operation is complete; also lets the transfer progress."""

    @abc.abstractmethod
    def wait(self):
        """Block until complete; a receive returns (src, out)."""

    def needs_progress(self) -> bool:
        """Whether the caller's progress calls still matter: not complete, and not finished by the peer alone."""
        return not self.test()


class BaseCommunicator(abc.ABC):
    """Point-to-point messages between the `num_devices` ranks of one program."""

    def __init__(self, num_devices: int):
        check_num_devices(num_devices)
        self.num_devices = int(num_devices)
        self._traffic: dict[int, Traffic] = {}  # made on first use
        self.tracer: Tracer | None = None  # records sends, waits and transfers when set

    @contextmanager
    def quiet_waits(self, pause: float):
        """Meanwhile this rank's waits sleep up to `pause` seconds between polls, so they leave the cores to a
        rank that measures alone (a wait on threads already blocks without polling)."""
        yield

    def traffic(self, rank: int) -> Traffic:
        """The messages and bytes rank `rank` has sent and received so far."""
        check_rank("rank", rank, self.num_devices)
        return self._traffic.setdefault(rank, Traffic())

    @abc.abstractmethod
    def send(self, src: int, dst: int, data, tag: int = 0) -> None:
        """Send a copy of array `data` from rank `src` to rank `dst`; never blocks."""

    @abc.abstractmethod
    def recv(self, dst: int, src: int = ANY, tag: int = ANY) -> tuple[int, np.ndarray]:
        """Wait for the oldest message to rank `dst` that matches `src` and `tag`.

        Returns (sender rank, array) with the array's shape and dtype as sent.
        """

    @abc.abstractmethod
    def isend(self, src: int, dst: int, data: np.ndarray, tag: int = 0) -> Request:
        """Start sending `data` without copying it; do not modify it until the request completes."""

    @abc.abstractmethod
    def irecv(self, dst: int, src: int, tag: int, out: np.ndarray) -> Request:
        """Start receiving the next message from `src` with `tag` straight into `out`.

        `wait()` returns (src, out); a message whose dtype or shape is not
        `out`'s is a CommError naming both ranks.
        """

    def _trace(self, rank: int, name: str, category: str, start_us: float, **args) -> None:
        """Record a span of `rank` from `start_us` to now, if tracing."""
        if self.tracer is not None:
            self.tracer.span(rank, name, category, start_us, now_us(), **args)

    def _check_send(self, src, dst, tag) -> None:
        check_rank("src", src, self.num_devices)
        check_rank("dst", dst, self.num_devices)
        check_tag(tag, allow_any=False)

    def _check_recv(self, dst, src, tag) -> None:
        check_rank("dst", dst, self.num_devices)
        if src != ANY:
            check_rank("src", src, self.num_devices)
        check_tag(tag, allow_any=True)

    def _check_irecv(self, dst, src, tag, out) -> None:
        # A definite source and tag: the data must come from the sender the header came from.
        check_rank("dst", dst, self.num_devices)
        check_rank("src", src, self.num_devices)
        check_tag(tag, allow_any=False)
        check_out(out)
