"""The validation split's draw by document, on the read functions of the prepare pipeline (no Ray):
the two splits hold disjoint documents that together are the corpus, and the seed alone decides."""

from __future__ import annotations

import json

import pytest

from raytrain_ft.data.prepare import PrepareSettings, document_keys, read_documents, validation_size

SETTINGS = PrepareSettings(validation_fraction=0.2, validation_min_docs=1)


@pytest.fixture
def corpus(tmp_path) -> tuple[list[str], dict[str, str]]:
    """Two jsonl files (25 + 25 documents) and 10 text files: 60 documents, each text unique."""
    docs = {i: f"document {i}: " + "x" * (i % 7) for i in range(60)}
    paths = []
    for k, part in enumerate((range(0, 25), range(25, 50))):
        paths.append(str(tmp_path / f"part-{k}.jsonl"))
        (tmp_path / f"part-{k}.jsonl").write_text("".join(json.dumps({"text": docs[i]}) + "\n" for i in part))
    for i in range(50, 60):
        paths.append(str(tmp_path / f"doc-{i}.txt"))
        (tmp_path / f"doc-{i}.txt").write_text(docs[i])
    return paths, {d: i for i, d in docs.items()}


def split(paths: list[str], seed: int) -> tuple[set[int], set[int], int]:
    """(training ids, held-out ids, documents counted) as the pipeline's passes produce them."""
    task = {"task": [0], "paths": [paths]}
    [counted] = document_keys(task, seed=seed, keep=SETTINGS.validation_max_docs)
    total, keys = counted["documents"][0], [tuple(k) for k in json.loads(counted["keys"][0])]
    held_out = sorted(keys)[validation_size(total, SETTINGS) - 1]
    read = {
        validation: [d for b in read_documents(task, seed, held_out, validation) for d in b["text"]]
        for validation in (False, True)
    }
    return set(read[False]), set(read[True]), total


def test_the_splits_hold_disjoint_documents_that_together_are_the_corpus(corpus):
    paths, ids = corpus
    train, held_out, total = split(paths, seed=0)
    assert total == 60 and len(held_out) == validation_size(60, SETTINGS) == 12 and len(train) == 48
    assert not train & held_out and train | held_out == set(ids)
    again, held_again, _ = split(paths, seed=0)
    assert (again, held_again) == (train, held_out)  # a re-run holds out the same documents
    assert split(paths, seed=1)[1] != held_out  # another seed, another draw


@pytest.mark.parametrize(
    "documents, held_out",
    [(1, 0), (10, 5), (60, 16), (4_000, 20), (10**7, 10_000)],
    ids=["one-document", "half-at-most", "floor", "fraction", "cap"],
)
def test_the_split_size_is_the_fraction_between_floor_and_cap(documents, held_out):
    assert validation_size(documents, PrepareSettings()) == held_out
