"""Text from a trained LM, as it comes: the one path `python -m spmd generate` and `run.generate` share.

A TextSampler checks the controls and encodes the prompt when it is made (so a mistake is refused before any
text is printed), then yields each sample's text piece by piece as spmd.model.decode draws the tokens. A piece
is released once it is final: a character split over tokens (a multi-byte UTF-8 character of the byte
tokenizer) decodes as U+FFFD until its last token comes, so trailing U+FFFDs wait; and text that may be the
start of a stop text waits until it is not. The pieces joined are the text a whole call returns. This needs of
a tokenizer only `end`, `encode` and `decode`, and that decoding more ids extends the text of fewer once its
characters are whole (true of byte-level tokenizers).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import numpy as np

from spmd.data.tokenizer import Tokenizer
from spmd.model.decode import check_sampling, cli_flag, sample_rng, tokens

SPLIT = "\ufffd"  # what a character split over tokens decodes as, until its last token comes


@dataclass(frozen=True)
class Controls:
    """The sampling controls of nanoGPT and llm.c: see spmd.model.decode.probabilities; `stop`: texts that end a
    sample as soon as its generated text contains one (the stop text is left out)."""

    max_tokens: int = 200
    temperature: float = 0.8
    top_k: int = 40
    top_p: float = 1.0
    stop: tuple[str, ...] = ()
    seed: int = 0

    def check(self, name: Callable[[str], str] = cli_flag) -> None:
        """Refuse a control out of range, naming it as `name` spells it."""
        check_sampling(self.max_tokens, self.temperature, self.top_k, self.top_p, name)
        if any(text == "" for text in self.stop):
            raise ValueError(f"{name('stop')}: an empty stop text would end every sample before it starts")


def stop_texts(stop: str | Sequence[str] | None) -> tuple[str, ...]:
    """One stop text or several, as a tuple (a lone string is one text, not its characters)."""
    if stop is None:
        return ()
    return (stop,) if isinstance(stop, str) else tuple(stop)


def prompt_ids(tokenizer: Tokenizer, prompt: str | None, positions: int, flag: str = "--prompt") -> np.ndarray:
    """The prompt's ids, refused naming `flag` when empty, not encodable, or longer than the model's positions;
    no prompt (None) starts where a document starts, after the end-of-document token."""
    if prompt is None:
        return np.array([tokenizer.end])
    encodable(prompt, flag)
    try:
        ids = np.asarray(tokenizer.encode(prompt))
    except UnicodeError as exc:
        raise ValueError(f"{flag}: {exc}") from None
    if len(ids) == 0:
        raise ValueError(f"{flag} is empty: give some text, or leave it out to start where a document starts")
    if len(ids) > positions:
        raise ValueError(
            f"{flag} is {len(ids)} tokens, more than the model's {positions} positions (it trained "
            f"with --seq {positions}): give a shorter prompt"
        )
    return ids


def encodable(text: str, flag: str) -> None:
    """Refuse text that cannot be UTF-8, naming the first such character's position. A lone surrogate is what
    Python makes of a command-line byte that is not UTF-8 (U+DC80 + the byte)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        char = text[exc.start]
        byte = f", the byte 0x{ord(char) - 0xDC00:02x} that is not UTF-8" if "\udc80" <= char <= "\udcff" else ""
        raise ValueError(
            f"{flag}: character {exc.start + 1} of {len(text)}, {char!r}{byte}, cannot be encoded (give UTF-8 text)"
        ) from None


class TextSampler:
    """Samples of one prompt under one set of controls, from a model's units (see the module's docstring)."""

    def __init__(
        self,
        net,
        units: list[np.ndarray],
        biases: dict[int, np.ndarray] | None,
        tokenizer: Tokenizer,
        prompt: str | None,
        controls: Controls,
        name: Callable[[str], str] = cli_flag,
        prompt_flag: str = "--prompt",
    ):
        controls.check(name)
        self.net, self.units, self.biases, self.tokenizer = net, units, biases, tokenizer
        self.prompt, self.controls = prompt or "", controls
        self.start = prompt_ids(tokenizer, prompt, net.seq, prompt_flag)

    def pieces(self, index: int = 0) -> Iterator[str]:
        """Sample `index`'s text as it comes: the prompt, then each piece of new text once it is final; it ends
        at max_tokens or as soon as the new text contains a stop text (no more tokens are drawn)."""
        if self.prompt:
            yield self.prompt
        c = self.controls
        text = NewText(self.tokenizer, c.stop)
        rng = sample_rng(c.seed, index)
        for token in tokens(
            self.net, self.units, self.start, c.max_tokens, c.temperature, c.top_k, c.top_p, rng, self.biases
        ):
            piece = text.add(token)
            if piece:
                yield piece
            if text.stopped:
                return
        piece = text.finish()
        if piece:
            yield piece

    def text(self, index: int = 0) -> str:
        """Sample `index`'s whole text: its pieces joined."""
        return "".join(self.pieces(index))


class NewText:
    """The text of the ids sampled so far, released piece by piece once final (see the module's docstring)."""

    def __init__(self, tokenizer: Tokenizer, stop: tuple[str, ...]):
        self.tokenizer, self.stop = tokenizer, stop
        self.ids: list[int] = []
        self.shown = 0  # characters released
        self.stopped = False

    def add(self, token: int) -> str:
        self.ids.append(token)
        return self.release(self.tokenizer.decode(self.ids).rstrip(SPLIT), final=False)

    def finish(self) -> str:
        """The rest, at the last token: a split character never completed stays U+FFFD, as decode gives it."""
        return self.release(self.tokenizer.decode(self.ids), final=True)

    def release(self, text: str, final: bool) -> str:
        cut = first_stop(text, self.stop)
        if cut is not None:
            self.stopped = True
        end = cut if cut is not None else len(text) if final else len(text) - held_back(text, self.stop)
        piece = text[self.shown : end]
        self.shown = max(self.shown, end)
        return piece


def first_stop(text: str, stop: tuple[str, ...]) -> int | None:
    """Where the first stop text in `text` begins (None: none is in it)."""
    found = [at for at in (text.find(s) for s in stop) if at >= 0]
    return min(found) if found else None


def held_back(text: str, stop: tuple[str, ...]) -> int:
    """The length of the longest end of `text` that a stop text begins with: it may yet become that stop text."""
    return max((k for s in stop for k in range(1, len(s)) if text.endswith(s[:k])), default=0)
