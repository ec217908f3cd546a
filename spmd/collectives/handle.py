"""A collective in flight: the handle of an asynchronous all-gather, reduce-scatter or all-reduce.

A collective is written once as a generator of steps: each step posts its receive and its send and yields
the two requests; the code after the yield (adding a received chunk) runs once both are done. The
blocking form runs the steps to the end; the started form returns a Handle the caller progresses between
compute panels (each request's test() lets MPI move its bytes) and waits on before using the result.
"""

from __future__ import annotations


class Handle:
    """A collective in flight: its steps (each posts a ring step's receive and send) run as far as the
    messages allow at each progress(), and to the end at wait(). Blocking and started forms run the same
    steps, so results and bytes are the same."""

    def __init__(self, steps):
        self._steps, self._pending, self.done, self.result = steps, (), False, None
        self._advance()

    def _advance(self) -> None:
        try:
            self._pending = next(self._steps)
        except StopIteration as finished:
            self.done, self.result, self._pending = True, finished.value, ()

    def progress(self) -> bool:
        """Move on as far as the messages in flight allow, without blocking; True once done."""
        while not self.done and all([r.test() for r in self._pending]):  # test each: each test moves it
            self._advance()
        return self.done

    def wait(self):
        """Finish (blocking); the result: the gathered or reduced array."""
        while not self.done:
            for request in self._pending:  # the receive first: on threads a send completes when received
                request.wait()
            self._advance()
        return self.result


def run(steps):
    """A collective's steps to the end, blocking: its result."""
    return Handle(steps).wait()
