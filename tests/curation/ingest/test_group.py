"""A shard group's unit records are read back as untrusted data (issue 32): a name in one that leaves the output
directory is refused in one line naming the record and the field, and nothing outside is ever deleted; locally
and through the object store (an object edited in the bucket must not delete a local directory outside the
cache)."""

from __future__ import annotations

import json
import os

import pytest

import curation.ingest.prepare as prep
import curation.ingest.units as units
from curation.io import objects, storage
from curation.io.shards import read_column
from schemas.config import SourceConfig
from tests.curation.ingest.test_prepare import _cfg, corpus  # noqa: F401 (corpus: a fixture)


class _Killed(Exception):
    pass


def _killed_after_first_record(monkeypatch, cfg) -> None:
    """Run prepare until its first unit record is saved, then stop it as a kill would."""
    real = units._save_record
    saved = {"n": 0}

    def dying(unit, record):
        real(unit, record)
        saved["n"] += 1
        if saved["n"] == 1:
            raise _Killed()

    monkeypatch.setattr(units, "_save_record", dying)
    with pytest.raises(_Killed):
        prep.prepare(cfg)
    monkeypatch.setattr(units, "_save_record", real)


def _victim(tmp_path):
    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "precious.txt").write_text("keep me")
    return victim


def _edit_record(path: str, **changes) -> None:
    with open(path, encoding="utf-8") as f:
        rec = json.load(f)
    if "name" in changes:
        rec["parts"][0]["name"] = changes["name"]
    if changes.get("move_span"):
        rec["spans"][0][2] = 5  # another span than the plan's: the unit would be redone and its parts removed
    for k in ("source", "unit"):
        if k in changes:
            rec[k] = changes[k]
    with open(path, "w", encoding="utf-8") as f:
        json.dump(rec, f)


HOSTILE = ["../../victim", "/abs/victim", ".", "qa/../../../victim", "qa/part\n", "qa/pa\x00rt", ""]


@pytest.mark.parametrize("name", HOSTILE)
def test_a_unit_record_naming_a_part_outside_the_output_is_refused_and_nothing_is_deleted(tmp_path, corpus,  # noqa: F811
                                                                                           monkeypatch, name):
    cfg = _cfg(tmp_path, corpus[0][:1], validation=[], sequences_per_part=2)
    victim = _victim(tmp_path)
    _killed_after_first_record(monkeypatch, cfg)
    record = os.path.join(cfg.output_dir, "candidates", "qa", "unit-00000.json")
    assert os.path.normpath(os.path.join(cfg.output_dir, "candidates", "../../victim")) == str(victim)
    _edit_record(record, name=name, move_span=True)
    with pytest.raises(ValueError) as e:
        prep.prepare(cfg)
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith(f"{record}: invalid work unit record: parts.0.name: {name!r} is not a "
                                               "relative path of names that are each 1 to 100 characters"), msg
    assert (victim / "precious.txt").read_text() == "keep me"


def test_a_unit_record_of_another_part_name_is_refused_even_when_inside(tmp_path, corpus, monkeypatch):  # noqa: F811
    """A safe-looking name the code would not have written for that unit (another unit's part) is refused too:
    only paths the code builds from validated parts are ever deleted."""
    cfg = _cfg(tmp_path, corpus[0][:1], validation=[], sequences_per_part=2)
    _killed_after_first_record(monkeypatch, cfg)
    record = os.path.join(cfg.output_dir, "candidates", "qa", "unit-00000.json")
    keep = os.path.join(cfg.output_dir, "candidates", "qa", "keep")
    os.makedirs(keep)
    _edit_record(record, name="qa/keep", move_span=True)
    with pytest.raises(ValueError, match=r"parts\[0\]\.name 'qa/keep' is not the name this unit's part 0 has "
                                              r"\('qa/part-00000-00000'\)"):
        prep.prepare(cfg)
    assert os.path.isdir(keep)


def test_a_unit_record_of_another_source_or_unit_is_refused(tmp_path, corpus, monkeypatch):  # noqa: F811
    cfg = _cfg(tmp_path, corpus[0][:1], validation=[], sequences_per_part=2)
    _killed_after_first_record(monkeypatch, cfg)
    record = os.path.join(cfg.output_dir, "candidates", "qa", "unit-00000.json")
    _edit_record(record, source="../x")
    with pytest.raises(ValueError, match=r"unit-00000\.json: source '\.\./x' is not this record's source 'qa'"):
        prep.prepare(cfg)
    _edit_record(record, source="qa", unit=3)
    with pytest.raises(ValueError, match=r"unit-00000\.json: unit 3 is not this record's unit 0"):
        prep.prepare(cfg)


def test_a_source_folder_that_is_a_symlink_leaving_the_output_is_refused(tmp_path, corpus, monkeypatch):  # noqa: F811
    cfg = _cfg(tmp_path, corpus[0][:1], validation=[], sequences_per_part=2)
    victim = _victim(tmp_path)
    (victim / "part-00000-00000").mkdir()
    (victim / "unit-00000.json").write_text("{}")
    _killed_after_first_record(monkeypatch, cfg)
    folder = os.path.join(cfg.output_dir, "candidates", "qa")
    import shutil

    shutil.rmtree(folder)
    os.symlink(victim, folder)
    with pytest.raises(ValueError, match=r"leads outside"):
        prep.prepare(cfg)
    assert sorted(os.listdir(victim)) == ["part-00000-00000", "precious.txt", "unit-00000.json"]


def test_a_unit_record_edited_in_the_bucket_does_not_delete_a_local_directory(tmp_path, corpus, monkeypatch, s3):  # noqa: F811
    """The bucket case: anyone who can write the bucket must not be able to delete files on the machines that
    prepare into it."""
    cfg = _cfg(tmp_path, corpus[0][:1], validation=[], sequences_per_part=2)
    cfg = cfg.model_copy(update={"output_dir": s3.url("data")})
    _killed_after_first_record(monkeypatch, cfg)
    key = "data/candidates/qa/unit-00000.json"
    body = json.loads(objects.read_object(s3.url(key)).body)
    cand = storage.local_path(s3.url("data/candidates"))
    victim = _victim(tmp_path)
    hostile = os.path.relpath(victim, cand)  # ../../../.. up out of the cache, down to victim
    assert os.path.normpath(os.path.join(cand, hostile)) == str(victim)
    body["parts"][0]["name"] = hostile
    body["spans"][0][2] = 5
    objects.write_object(s3.url(key), json.dumps(body).encode())
    import shutil

    shutil.rmtree(s3.cache)  # another machine, or a stale cache: the record comes from the bucket
    with pytest.raises(ValueError) as e:
        prep.prepare(cfg)
    assert f"unit-00000.json: invalid work unit record: parts.0.name: {hostile!r}" in str(e.value)
    assert "\n" not in str(e.value)
    assert (victim / "precious.txt").read_text() == "keep me"


@pytest.mark.parametrize("inputs", ["all there", "one gone"])
def test_a_unit_record_naming_another_file_of_the_machine_is_refused_before_it_is_read(tmp_path, corpus,  # noqa: F811
                                                                                       inputs):
    """A record's spans are the files a damaged part is regenerated from: one naming a file that is not an input
    of its source (a credentials file) is refused before it is read, also when another input of the source is gone
    (the check was skipped then: the rerun tokenized the file named into the output, and uploaded it)."""
    import shutil

    raw = tmp_path / "raw"
    (raw / "e.txt").write_text((raw / "d.txt").read_text()[::-1])
    source = SourceConfig(name="txt", paths=[str(raw / "d.txt"), str(raw / "e.txt")])
    cfg = _cfg(tmp_path, [source], validation=[], sequences_per_part=2, unit_bytes=1)  # a unit per file
    res = prep.prepare(cfg)
    out = res.dirs["candidates"]
    secret = tmp_path / "credentials.txt"
    secret.write_text("aws_secret_access_key hunter2\n\n" * 200)
    record = next(os.path.join(out, "txt", f) for f in sorted(os.listdir(os.path.join(out, "txt")))
                  if f.startswith("unit-") and str(raw / "d.txt") in open(os.path.join(out, "txt", f)).read())
    with open(record, encoding="utf-8") as f:
        rec = json.load(f)
    rec["spans"] = [[str(secret) if p == str(raw / "d.txt") else p, a, b] for p, a, b in rec["spans"]]
    rec["inputs"] = []  # no fingerprints to compare (an older version's record)
    with open(record, "w", encoding="utf-8") as f:
        json.dump(rec, f)
    if inputs == "one gone":
        (raw / "e.txt").unlink()
    damaged = os.path.join(out, rec["parts"][0]["name"])
    shutil.rmtree(damaged)  # regenerated by a rerun, from the record's spans
    with pytest.raises(ValueError) as e:
        prep.prepare(cfg)
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith(f"{record}: spans names {str(secret)!r}, not a file of source 'txt'; "
                                              "refused"), msg
    assert not os.path.exists(damaged)
    parts = [os.path.join(out, "txt", d) for d in os.listdir(os.path.join(out, "txt")) if d.startswith("part-")]
    text = "".join(res.tokenizer.tokenizer.decode(row.tolist()) for p in parts for row in read_column(p, "tokens"))
    assert "alpha" in text and "hunter2" not in text  # the parts left are read (words of d.txt), the secret is in none


# ------------------------------------------------------------------------------------------------
# changed inputs: refused after a finished prepare, their units redone after a killed one; never mixed
# ------------------------------------------------------------------------------------------------
def test_an_input_cut_after_a_finished_prepare_is_refused_naming_it(tmp_path, corpus):  # noqa: F811
    cfg = _cfg(tmp_path, corpus[0][:1], validation=[])
    prep.prepare(cfg)
    src = tmp_path / "raw" / "a.jsonl"
    lines = src.read_text().splitlines(keepends=True)
    src.write_text("".join(lines[:len(lines) // 2]))  # the old version: rc 0 and the old counts
    with pytest.raises(ValueError) as e:
        prep.prepare(cfg)
    assert str(e.value).startswith(f"{src}: changed since {cfg.output_dir}/candidates was prepared from it (its size, "
                                   "mtime and content hash differ from ")


def test_a_same_length_edit_after_a_finished_prepare_is_refused_and_a_touch_is_not(tmp_path, corpus):  # noqa: F811
    cfg = _cfg(tmp_path, corpus[0][:1], validation=[], unit_bytes=4000)
    prep.prepare(cfg)
    src = tmp_path / "raw" / "a.jsonl"
    text = src.read_text()
    os.utime(src, ns=(1, 1))  # same bytes, another mtime (a copy): hashed, equal, accepted
    assert prep.prepare(cfg).tokens_processed == 0
    src.write_text(text.replace("alpha", "omega", 1))
    with pytest.raises(ValueError, match=f"^{src}: changed since"):
        prep.prepare(cfg)


def test_a_same_length_edit_inside_a_finished_unit_of_a_killed_prepare_redoes_that_unit(tmp_path, corpus,  # noqa: F811
                                                                                        monkeypatch):
    """A unit finished before the kill, then a same-length edit inside its bytes: the rerun redoes that unit from
    the new text, so the result equals a clean prepare of the edited input (on 4702e04 it mixed old and new)."""
    from tests.curation.ingest.test_prepare import _rows

    src = tmp_path / "raw" / "a.jsonl"
    cfg = _cfg(tmp_path / "killed", corpus[0][:1], validation=[], sequences_per_part=2, unit_bytes=4000)
    real = units._save_record
    done = {"units": 0}

    def dying(unit, record):
        real(unit, record)
        done["units"] += record.done
        if done["units"] == 1 and not record.done:  # unit 0 done, unit 1 has a part: kill
            raise _Killed()

    monkeypatch.setattr(units, "_save_record", dying)
    with pytest.raises(_Killed):
        prep.prepare(cfg)
    monkeypatch.setattr(units, "_save_record", real)
    text = src.read_text()
    first = text.index("alpha")
    assert first < 3000  # inside unit 0's bytes
    src.write_text(text[:first] + "omega" + text[first + 5:])
    with pytest.warns(UserWarning, match=rf"unit-00000\.json: its input {src} changed since it was written"):
        res = prep.prepare(cfg)
    clean = prep.prepare(_cfg(tmp_path / "clean", corpus[0][:1], validation=[], sequences_per_part=2,
                              unit_bytes=4000))
    assert _rows(res.dirs["candidates"]) == _rows(clean.dirs["candidates"])


def test_a_too_small_validation_source_is_prepared_once_data_is_added(tmp_path, corpus):  # noqa: F811
    """Issue 32: the refusal stayed after data was added to the same file (its unit was recorded as done, with no
    part, and never read again); the file's fingerprint now says it changed, so the unit is redone."""
    small = tmp_path / "raw" / "v.jsonl"
    small.write_text(json.dumps({"text": "tiny"}) + "\n")
    from schemas.config import SourceConfig

    cfg = _cfg(tmp_path, corpus[0][:1], validation=[SourceConfig(name="val", paths=[str(small)])])
    with pytest.raises(ValueError, match="validation: no sequence of 32 tokens was produced"):
        prep.prepare(cfg)
    with open(small, "a") as f:
        f.write("".join(json.dumps({"text": " ".join(["alpha beta gamma"] * 20)}) + "\n" for _ in range(5)))
    with pytest.warns(UserWarning, match=rf"unit-00000\.json: its input {small} changed since it was written"):
        res = prep.prepare(cfg)
    assert res.manifests["validation"].complete and res.manifests["validation"].sources["val"].sequences > 0
