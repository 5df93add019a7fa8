"""GSM8KDataModule on real GSM8K rows, and the resumable seeded training order."""

from __future__ import annotations

import json

import pytest
from lightning.fabric.utilities.apply_func import move_data_to_device

from tandem_lit.data import GSM8KDataModule, PromptRows, SeededBatches
from tandem_lit.errors import ConfigError, DataError


@pytest.fixture(scope="module")
def sample(repo_root):
    return repo_root / "data" / "gsm8k-sample"


@pytest.fixture(scope="module")
def raw_train(sample):
    return [json.loads(line) for line in (sample / "train.jsonl").read_text().splitlines()]


def questions(rows) -> list[str]:
    return [r["question"] for r in rows]


def test_rows_have_prompt_answer_and_solution(sample, raw_train):
    dm = GSM8KDataModule(source=str(sample), val_size=8, batch_size=4)
    train = dm.rows("train")
    first = next(r for r in train if r["question"] == raw_train[0]["question"])
    assert first["prompt"] == f"Question: {raw_train[0]['question']}\nAnswer:"
    assert first["answer"] == "72"  # "... #### 72"
    assert first["solution"] == raw_train[0]["answer"]
    for row in train:
        assert row["answer"] == row["solution"].rsplit("####", 1)[1].strip()
        assert row["answer"].lstrip("-").replace(",", "").replace(".", "").isdigit()


def test_prompt_template_uses_row_fields(sample):
    dm = GSM8KDataModule(source=str(sample), val_size=4, prompt_template="Solve: {question}\nEnd with #### N.\n")
    row = dm.rows("val")[0]
    assert row["prompt"] == f"Solve: {row['question']}\nEnd with #### N.\n"


def test_val_and_train_are_disjoint_seeded_and_cover_the_split(sample, raw_train):
    a = GSM8KDataModule(source=str(sample), val_size=8, seed=0)
    b = GSM8KDataModule(source=str(sample), val_size=8, seed=0)
    c = GSM8KDataModule(source=str(sample), val_size=8, seed=1)
    train, val = questions(a.rows("train")), questions(a.rows("val"))
    assert len(val) == 8 and len(train) == len(raw_train) - 8
    assert not set(train) & set(val)
    assert sorted(train + val) == sorted(questions(raw_train))
    assert val == questions(b.rows("val")) and train == questions(b.rows("train"))
    assert set(val) != set(questions(c.rows("val")))


def test_limits_and_test_split(sample):
    dm = GSM8KDataModule(source=str(sample), val_size=8, train_limit=10, test_limit=5)
    assert len(dm.rows("train")) == 10
    assert len(dm.rows("test")) == 5
    test_questions = questions(dm.rows("test"))
    assert not set(test_questions) & set(questions(GSM8KDataModule(source=str(sample), val_size=8).rows("train")))


def test_single_file_and_json_array_sources(tmp_path, raw_train):
    jsonl = tmp_path / "mine.jsonl"
    jsonl.write_text("\n".join(json.dumps(r) for r in raw_train[:12]) + "\n")
    array = tmp_path / "mine.json"
    array.write_text(json.dumps(raw_train[:12]))
    for source in (jsonl, array):
        dm = GSM8KDataModule(source=str(source), val_size=2)
        assert len(dm.rows("train")) == 10 and len(dm.rows("val")) == 2


def write_split(folder, rows, split="train"):
    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"{split}.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return folder


def test_row_missing_answer_field_names_it(tmp_path, raw_train):
    rows = [dict(r) for r in raw_train[:6]]
    del rows[3]["answer"]
    folder = write_split(tmp_path / "broken", rows)
    with pytest.raises(DataError, match=r"row 3 has no field 'answer'"):
        GSM8KDataModule(source=str(folder), val_size=1).rows("train")


def test_configured_field_that_does_not_exist_is_named(sample):
    with pytest.raises(DataError, match=r"no field 'nope'.*answer_field"):
        GSM8KDataModule(source=str(sample), val_size=2, answer_field="nope").rows("train")


def test_answer_without_final_number_and_missing_path(tmp_path, raw_train):
    rows = [dict(r) for r in raw_train[:4]]
    rows[0]["answer"] = "no final line"
    folder = write_split(tmp_path / "nofinal", rows)
    with pytest.raises(DataError, match="####"):
        GSM8KDataModule(source=str(folder), val_size=1).rows("train")
    with pytest.raises(DataError, match="does not exist"):
        GSM8KDataModule(source=str(tmp_path / "missing" / "x"), val_size=1).rows("train")
    with pytest.raises(DataError, match="test.jsonl"):
        GSM8KDataModule(source=str(folder), val_size=1).rows("test")


# ---------------------------------------------------------------------------------- SeededBatches

ROWS = [{"prompt": f"p{i}", "answer": str(i)} for i in range(22)]  # 22 rows / 4 = 5 batches, 2 dropped


def ids(batch) -> list[str]:
    return [r["prompt"] for r in batch]


def consume(loader: SeededBatches, k: int) -> list[list[str]]:
    """Take k batches from a fresh iteration, marking each finished, as the module does."""
    out = []
    for batch in loader:
        if len(out) == k:
            break
        batch.mark_consumed()
        out.append(ids(batch))
    return out


def test_seeded_order_and_epoch_reshuffle():
    a, b, c = SeededBatches(ROWS, 4, seed=0), SeededBatches(ROWS, 4, seed=0), SeededBatches(ROWS, 4, seed=1)
    assert len(a) == 5
    epoch0 = consume(a, 5)
    assert epoch0 == consume(b, 5)
    assert epoch0 != consume(c, 5)
    flat = [p for batch in epoch0 for p in batch]
    assert len(flat) == len(set(flat)) == 20  # no row twice in an epoch
    assert flat != [f"p{i}" for i in range(20)]  # shuffled
    epoch1 = consume(a, 5)
    assert epoch1 != epoch0  # reshuffled
    assert epoch1 == consume(b, 5)  # ... the same way for the same seed
    assert a.epoch == 1 and a.position == 5


@pytest.mark.parametrize("k", [0, 1, 3, 4])
def test_resume_mid_epoch_yields_exactly_the_remaining_batches(k):
    straight = consume(SeededBatches(ROWS, 4, seed=7), 5)
    first = SeededBatches(ROWS, 4, seed=7)
    assert consume(first, k) == straight[:k]
    state = first.state_dict()
    resumed = SeededBatches(ROWS, 4, seed=7)
    resumed.load_state_dict(state)
    assert [ids(b) for b in resumed] == straight[k:]


def test_resume_at_epoch_boundary_starts_the_next_epoch():
    reference = SeededBatches(ROWS, 4, seed=3)
    consume(reference, 5)
    epoch1 = consume(reference, 5)
    first = SeededBatches(ROWS, 4, seed=3)
    consume(first, 5)  # the whole of epoch 0
    resumed = SeededBatches(ROWS, 4, seed=3)
    resumed.load_state_dict(first.state_dict())
    assert consume(resumed, 5) == epoch1
    # and the epoch after follows as in the uninterrupted run
    assert consume(resumed, 5) == consume(reference, 5)


def test_prefetched_batches_are_not_consumed():
    """Only batches the module finished move the position: a prefetched batch is drawn again."""
    loader = SeededBatches(ROWS, 4, seed=0)
    iterator = iter(loader)
    first = next(iterator)
    first.mark_consumed()
    second = next(iterator)  # fetched, never marked
    resumed = SeededBatches(ROWS, 4, seed=0)
    resumed.load_state_dict(loader.state_dict())
    assert ids(next(iter(resumed))) == ids(second)
    assert isinstance(second, PromptRows) and second.index == 1 and second.epoch == 0


def test_state_from_other_data_is_refused_and_bad_sizes():
    state = SeededBatches(ROWS, 4, seed=0).state_dict()
    with pytest.raises(ConfigError, match="differs"):
        SeededBatches(ROWS[:-1], 4, seed=0).load_state_dict(state)
    with pytest.raises(ConfigError, match="differs"):
        SeededBatches(ROWS, 4, seed=1).load_state_dict(state)
    with pytest.raises(ConfigError):
        SeededBatches(ROWS, 0, seed=0)
    with pytest.raises(ConfigError, match="fewer than one batch"):
        SeededBatches(ROWS[:3], 4, seed=0)


def test_datamodule_loaders(sample):
    dm = GSM8KDataModule(source=str(sample), val_size=8, batch_size=4, eval_batch_size=3, seed=2)
    train = dm.train_dataloader()
    assert train is dm.train_dataloader()  # one stateful loader per run
    assert len(train) == (256 - 8) // 4
    batch = next(iter(train))
    assert len(batch) == 4 and all({"prompt", "answer", "question"} <= set(r) for r in batch)
    val = list(dm.val_dataloader())
    assert [len(b) for b in val] == [3, 3, 2]
    assert [r["question"] for b in val for r in b] == questions(dm.rows("val"))


def test_batch_tags_survive_lightnings_device_transfer():
    """Lightning rebuilds lists when it moves a batch to the device; the batch's origin (epoch,
    index, loader) must survive, or the loader never advances and every step reuses step 0's seeds."""
    loader = SeededBatches(ROWS, 4, seed=0)
    iterator = iter(loader)
    next(iterator)
    batch = next(iterator)
    moved = move_data_to_device(batch, "cpu")
    assert (moved.epoch, moved.index) == (0, 1)
    assert ids(moved) == ids(batch) and len(moved) == 4 and moved[0] == batch[0]
    moved.mark_consumed()
    assert loader.state_dict()["position"] == 2
