"""Training batches: corpus documents tokenized and packed into fixed-length rows, in a seeded order.

Each epoch visits every training document once, in an order shuffled by ``random.Random`` seeded with the epoch.
Rows are filled with whole documents, each followed by ``<|end_of_text|>``, so every row starts at a document's
first token (position 0, as a served prompt does); a document that does not fit in what is left of a row starts
the next one, and the rest of the row is padding the loss ignores. A document longer than a row is cut to it.
Batches depend only on the corpus seed, the order seed and the shape, so step ``k``'s batch is the same in every
run; documents are generated and tokenized when a batch first needs them.
"""

from __future__ import annotations

import random
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch

from engine.model.embedded import END_OF_TEXT_TOKEN, PAD_TOKEN
from training.corpus import Corpus

IGNORE_INDEX = -100  # label of a position the loss skips (torch's cross_entropy default)


@dataclass(frozen=True)
class BatchConfig:
    seq_len: int = 768
    batch_size: int = 12
    order_seed: int = 0


@dataclass(frozen=True)
class Batch:
    input_ids: torch.Tensor  # [B, T] int64
    labels: torch.Tensor  # [B, T] int64, IGNORE_INDEX on padding

    @property
    def num_tokens(self) -> int:
        return int((self.labels != IGNORE_INDEX).sum().item())


class DocumentTokens:
    """Token ids of each document (text, then ``<|end_of_text|>``), computed once per document."""

    def __init__(self, corpus: Corpus) -> None:
        self.corpus = corpus
        tokenizer = corpus.tokenizer
        self.eot_id = _token_id(tokenizer.encode(END_OF_TEXT_TOKEN))
        self.pad_id = _token_id(tokenizer.encode(PAD_TOKEN))
        self._ids: dict[int, list[int]] = {}

    def __getitem__(self, index: int) -> list[int]:
        ids = self._ids.get(index)
        if ids is None:
            ids = [*self.corpus.tokenizer.encode(self.corpus.document(index).text), self.eot_id]
            self._ids[index] = ids
        return ids


def epoch_order(indices: Sequence[int] | range, order_seed: int, epoch: int) -> list[int]:
    order = list(indices)
    random.Random(f"ordinal-order:{order_seed}:{epoch}").shuffle(order)
    return order


def pack_rows(tokens: DocumentTokens, order: Sequence[int], seq_len: int) -> Iterator[list[int]]:
    """Rows of whole documents (each at most ``seq_len`` tokens, unpadded), in ``order``."""
    row: list[int] = []
    for index in order:
        ids = tokens[index][:seq_len]
        if row and len(row) + len(ids) > seq_len:
            yield row
            row = []
        row.extend(ids)
    if row:
        yield row


def to_batch(rows: Sequence[list[int]], seq_len: int, pad_id: int) -> Batch:
    input_ids = torch.full((len(rows), seq_len), pad_id, dtype=torch.long)  # [B, T]
    labels = torch.full((len(rows), seq_len), IGNORE_INDEX, dtype=torch.long)  # [B, T]
    for i, row in enumerate(rows):
        input_ids[i, : len(row)] = torch.tensor(row)
        labels[i, : len(row)] = torch.tensor(row)
    return Batch(input_ids, labels)


def training_batches(tokens: DocumentTokens, config: BatchConfig) -> Iterator[Batch]:
    """Training batches without end: epoch after epoch over the corpus' training documents."""
    epoch = 0
    pending: list[list[int]] = []
    while True:
        order = epoch_order(tokens.corpus.config.train_indices, config.order_seed, epoch)
        for row in pack_rows(tokens, order, config.seq_len):
            pending.append(row)
            if len(pending) == config.batch_size:
                yield to_batch(pending, config.seq_len, tokens.pad_id)
                pending = []
        epoch += 1


def held_out_batches(tokens: DocumentTokens, config: BatchConfig, num_batches: int) -> list[Batch]:
    """The first ``num_batches`` batches of held-out documents, in index order (for evaluation loss)."""
    rows = list(pack_rows(tokens, tokens.corpus.config.held_out_indices, config.seq_len))
    size = config.batch_size
    end = min(len(rows), size * num_batches)
    return [to_batch(rows[i : i + size], config.seq_len, tokens.pad_id) for i in range(0, end, size)]


def _token_id(ids: list[int]) -> int:
    if len(ids) != 1:
        raise ValueError(f"expected one special token id, got {ids}")
    return ids[0]
