"""Workload: the data shape of training — sequence length, global batch, lengths.

``global_batch`` is the number of sequences per optimizer step; it is the user's
training semantics and no plan may change it. An optional length distribution (a
histogram of token counts) decides how much of a padded micro-batch is padding and what
packing gains; without one every sequence is ``seq_len`` tokens long.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Iterable
from dataclasses import dataclass

from autofit.errors import SpecError

# The longest sequence a request may ask for: 2**20 tokens, the longest context
# windows released for fine-tuning (Qwen2.5-1M, the 1M-token Llama-3 variants) and 8x
# the longest of the registered families (131,072). The simulator builds real token
# tensors of micro-batch x seq-len, so a typo like 99999999999 would allocate 800 GB.
MAX_SEQ_LEN = 2**20

# Without a tokenizer we count tokens as characters / 4, the usual figure for English
# text under BPE vocabularies; the workload records that it is an approximation.
CHARS_PER_TOKEN = 4.0


@dataclass(frozen=True)
class LengthDistribution:
    """A histogram of sequence lengths in tokens: ``((length, count), ...)`` sorted."""

    histogram: tuple[tuple[int, int], ...]
    source: str = ""

    def __post_init__(self) -> None:
        if not self.histogram:
            raise SpecError("the length distribution is empty")
        for length, count in self.histogram:
            if length < 1 or count < 0:
                raise SpecError(f"bad length histogram entry ({length}, {count})")
        if sum(c for _, c in self.histogram) == 0:
            raise SpecError("the length distribution has no samples")

    @classmethod
    def from_lengths(cls, lengths: Iterable[int], source: str = "") -> LengthDistribution:
        counts: dict[int, int] = {}
        for n in lengths:
            n = max(1, int(n))
            counts[n] = counts.get(n, 0) + 1
        if not counts:
            raise SpecError(f"no sequences found in {source or 'the length data'}")
        return cls(tuple(sorted(counts.items())), source)

    def truncated(self, seq_len: int) -> LengthDistribution:
        counts: dict[int, int] = {}
        for length, count in self.histogram:
            key = min(length, seq_len)
            counts[key] = counts.get(key, 0) + count
        return LengthDistribution(tuple(sorted(counts.items())), self.source)

    @property
    def total(self) -> int:
        return sum(c for _, c in self.histogram)

    @property
    def mean(self) -> float:
        return sum(n * c for n, c in self.histogram) / self.total

    @property
    def std(self) -> float:
        m = self.mean
        return math.sqrt(sum(c * (n - m) ** 2 for n, c in self.histogram) / self.total)

    @property
    def max(self) -> int:
        return self.histogram[-1][0]

    def expected_max(self, k: int) -> float:
        """E[max of k samples]: the length a padded micro-batch of k sequences has."""
        total, cdf_prev, acc, cum = self.total, 0.0, 0.0, 0
        for n, c in self.histogram:
            cum += c
            cdf = cum / total
            acc += n * (cdf**k - cdf_prev**k)
            cdf_prev = cdf
        return acc

    def as_dict(self) -> dict:
        return {"histogram": [list(x) for x in self.histogram], "source": self.source}

    @classmethod
    def from_dict(cls, d: dict) -> LengthDistribution:
        """The inverse of :meth:`as_dict`."""
        return cls(tuple((int(n), int(c)) for n, c in d["histogram"]), d.get("source") or "")


@dataclass(frozen=True)
class Workload:
    seq_len: int = 2048
    global_batch: int = 16
    lengths: LengthDistribution | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.seq_len, int) or self.seq_len < 1:
            raise SpecError(f"--seq-len must be a positive integer, got {self.seq_len!r}")
        if self.seq_len > MAX_SEQ_LEN:
            raise SpecError(
                f"--seq-len {self.seq_len:,} is beyond the {MAX_SEQ_LEN:,} tokens autofit plans for "
                "(the longest context windows released); give a shorter --seq-len"
            )
        if not isinstance(self.global_batch, int) or self.global_batch < 1:
            raise SpecError(f"--global-batch must be a positive integer, got {self.global_batch!r}")
        if self.lengths is not None:
            object.__setattr__(self, "lengths", self.lengths.truncated(self.seq_len))

    @property
    def mean_tokens(self) -> float:
        """Real (non-padding) tokens per sequence."""
        return self.lengths.mean if self.lengths else float(self.seq_len)

    def padded_len(self, micro_batch: int) -> float:
        """Expected row length of a micro-batch padded to its longest sequence."""
        return self.lengths.expected_max(micro_batch) if self.lengths else float(self.seq_len)

    def packed_tokens_peak(self, micro_batch: int) -> int:
        """Tokens in the largest packed micro-batch to plan memory for (≈ p99.9)."""
        if not self.lengths:
            return micro_batch * self.seq_len
        d = self.lengths
        est = micro_batch * d.mean + 3.1 * d.std * math.sqrt(micro_batch)
        return int(min(micro_batch * self.seq_len, math.ceil(est)))

    def tokens_per_step(self) -> float:
        """Real tokens an optimizer step trains on (what effective tokens/s counts)."""
        return self.global_batch * self.mean_tokens

    def as_dict(self) -> dict:
        return {
            "seq_len": self.seq_len,
            "global_batch": self.global_batch,
            "lengths": self.lengths.as_dict() if self.lengths else None,
        }

    @classmethod
    def from_dict(cls, d: dict) -> Workload:
        """The inverse of :meth:`as_dict`."""
        lengths = d.get("lengths")
        return cls(
            seq_len=int(d["seq_len"]),
            global_batch=int(d["global_batch"]),
            lengths=LengthDistribution.from_dict(lengths) if lengths else None,
        )


def load_lengths(path: str, tokenizer=None) -> LengthDistribution:
    """Read a length distribution.

    - ``.json``: a histogram ``{"128": 40, "512": 3}`` or ``{"histogram": [[128, 40], ...]}``
    - ``.jsonl``: one record per line with ``num_tokens``/``length`` (ints) or ``text``
      (tokenized with ``tokenizer`` when given, else counted as characters / 4).
    """
    if not os.path.isfile(path):
        raise SpecError(f"length file {path!r} does not exist")
    try:
        if path.endswith(".jsonl"):
            lengths = []
            approx = False
            with open(path) as fh:
                for lineno, line in enumerate(fh, 1):
                    if not line.strip():
                        continue
                    rec = json.loads(line)
                    if not isinstance(rec, dict):
                        raise SpecError(f"{path}:{lineno}: expected a JSON object")
                    if "num_tokens" in rec or "length" in rec:
                        lengths.append(int(rec.get("num_tokens", rec.get("length"))))
                    elif isinstance(rec.get("text"), str):
                        if tokenizer is not None:
                            lengths.append(len(tokenizer(rec["text"])["input_ids"]))
                        else:
                            approx = True
                            lengths.append(math.ceil(len(rec["text"]) / CHARS_PER_TOKEN))
                    else:
                        raise SpecError(f"{path}:{lineno}: a record needs a 'text' string or a 'num_tokens' integer")
            src = path + (" (tokens ~ chars/4)" if approx else "")
            return LengthDistribution.from_lengths(lengths, src)
        with open(path) as fh:
            data = json.load(fh)
        if isinstance(data, dict) and "histogram" in data:
            pairs = [(int(n), int(c)) for n, c in data["histogram"]]
        elif isinstance(data, dict):
            pairs = [(int(n), int(c)) for n, c in data.items()]
        else:
            raise SpecError(f"{path}: expected a histogram object {{length: count}}")
        merged: dict[int, int] = {}
        for n, c in pairs:
            merged[n] = merged.get(n, 0) + c
        return LengthDistribution(tuple(sorted(merged.items())), path)
    except (OSError, ValueError, TypeError) as exc:
        if isinstance(exc, SpecError):
            raise
        raise SpecError(f"cannot read length file {path!r}: {exc}") from None
