"""What one rank sent and received: messages and payload bytes, per peer and tag."""

from collections import Counter
from dataclasses import dataclass, field


@dataclass
class Traffic:
    """Counters of one rank's messages; both backends record the same way.

    Bytes are payload bytes (the arrays' nbytes), not headers; a message is
    counted when a send starts and when a receive completes.
    """

    sent_messages: Counter = field(default_factory=Counter)  # (dst, tag) -> messages
    sent_bytes: Counter = field(default_factory=Counter)  # (dst, tag) -> bytes
    received_messages: Counter = field(default_factory=Counter)  # (src, tag) -> messages
    received_bytes: Counter = field(default_factory=Counter)  # (src, tag) -> bytes
    # ("send", dst, tag, bytes) / ("recv", src, tag, bytes), in order; kept only when keep_log is set (a test
    # asking what order messages went in), so a long run's memory does not grow with its messages
    log: list = field(default_factory=list)
    keep_log: bool = False

    def record_send(self, dst: int, tag: int, nbytes: int) -> None:
        self.sent_messages[(dst, tag)] += 1
        self.sent_bytes[(dst, tag)] += nbytes
        if self.keep_log:
            self.log.append(("send", dst, tag, nbytes))

    def record_receive(self, src: int, tag: int, nbytes: int) -> None:
        self.received_messages[(src, tag)] += 1
        self.received_bytes[(src, tag)] += nbytes
        if self.keep_log:
            self.log.append(("recv", src, tag, nbytes))

    def bytes_sent(self, tag: int | None = None) -> int:
        """Bytes sent to any peer, with `tag` only if given."""
        return sum(b for (_, t), b in self.sent_bytes.items() if tag in (None, t))

    def bytes_received(self, tag: int | None = None) -> int:
        """Bytes received from any peer, with `tag` only if given."""
        return sum(b for (_, t), b in self.received_bytes.items() if tag in (None, t))
