"""distlab.checkpoint on one process (a stand-in group), the samplers' state, and the elastic states: the file
layout, what is refused and how, the plan's rules. The MPI scenarios are in test_checkpoint_mpi.py."""
import os
import pickle
import sys
import threading

import numpy as np
import pytest

from distlab import ShardedArray, checkpoint
from distlab.checkpoint import _plan, _save, _storage
from distlab.collectives import elastic
from distlab.data import DistributedSampler, ElasticSampler
from distlab.errors import CheckpointException


class OneRank:
    """The group calls a save or a load makes, for a world of one."""

    rank, size = 0, 1

    def allgather_object(self, obj, name=None):
        return [pickle.loads(pickle.dumps(obj))]

    def broadcast_object(self, obj=None, src=0, name=None):
        return obj

    def broadcast(self, array, src=0, name=None):
        return array


G = OneRank()


def state():
    return {"model": {"fc.weight": np.arange(12, dtype=np.float32).reshape(3, 4), "scalar": np.array(2.5),
                      "empty": np.zeros((0, 3))},
            "optim": {"state": {"fc.weight": {"step": 3, "exp_avg": np.full((3, 4), 0.5)}}, "lr": [0.1, 0.2]},
            "step": 7, "name": "run", "list": [np.ones(2), {"a": np.zeros(1)}]}


def blank():
    return {"model": {"fc.weight": np.zeros((3, 4), np.float32), "scalar": np.zeros(()), "empty": np.ones((0, 3))},
            "optim": {"state": {"fc.weight": {}}, "lr": None},
            "step": 0, "name": None, "list": [np.zeros(2), {"a": np.ones(1)}]}


def assert_loaded(got):
    want = state()
    assert np.array_equal(got["model"]["fc.weight"], want["model"]["fc.weight"])
    assert got["model"]["scalar"] == 2.5 and got["step"] == 7 and got["name"] == "run"
    assert got["optim"]["state"]["fc.weight"]["step"] == 3 and got["optim"]["lr"] == [0.1, 0.2]
    assert np.array_equal(got["optim"]["state"]["fc.weight"]["exp_avg"], np.full((3, 4), 0.5))
    assert np.array_equal(got["list"][0], np.ones(2)) and np.array_equal(got["list"][1]["a"], np.zeros(1))


def test_round_trip_fills_in_place_and_fills_empty_dicts(tmp_path):
    metadata = checkpoint.save(state(), tmp_path / "c", group=G)
    assert sorted(os.listdir(tmp_path / "c")) == [".metadata", "__0_1.distcp"]
    assert metadata["items"]["model.fc.weight"]["chunks"][0]["checksum"]
    target = blank()
    live = target["model"]["fc.weight"]
    checkpoint.load(target, tmp_path / "c", group=G)
    assert target["model"]["fc.weight"] is live  # filled in place
    assert_loaded(target)
    assert checkpoint.verify(tmp_path / "c")["generation"] == 1


def test_saving_over_a_checkpoint_keeps_the_old_one_until_the_new_metadata(tmp_path):
    directory = tmp_path / "c"
    checkpoint.save(state(), directory, group=G)
    (directory / "__0_7.distcp").write_bytes(b"left by a save that died")
    changed = state()
    changed["step"] = 8
    assert checkpoint.save(changed, directory, group=G)["generation"] == 8  # past every generation seen
    assert sorted(os.listdir(directory)) == [".metadata", "__0_8.distcp"]  # older and stray files removed
    target = blank()
    checkpoint.load(target, directory, group=G)
    assert target["step"] == 8


@pytest.mark.parametrize("damage,message", [
    ("flip", "'model.fc.weight' (offset"),
    ("truncate", "holds 10 bytes, the metadata says"),
    ("remove", "the data file is missing"),
    ("metadata", "metadata"),
    ("no-metadata", "a save that did not finish"),
])
def test_a_damaged_checkpoint_is_refused_and_nothing_is_touched(tmp_path, damage, message):
    directory = tmp_path / "c"
    checkpoint.save(state(), directory, group=G)
    data = directory / "__0_1.distcp"
    if damage == "flip":
        raw = bytearray(data.read_bytes())
        offset = checkpoint.read_metadata(directory)["items"]["model.fc.weight"]["chunks"][0]["offset"]
        raw[offset + 5] ^= 0x10
        data.write_bytes(bytes(raw))
    elif damage == "truncate":
        data.write_bytes(data.read_bytes()[:10])
    elif damage == "remove":
        data.unlink()
    elif damage == "metadata":
        (directory / ".metadata").write_text("{not json")
    else:
        (directory / ".metadata").unlink()
    target = blank()
    with pytest.raises(CheckpointException, match="rank 0") as raised:
        checkpoint.load(target, directory, group=G)
    assert message in str(raised.value)
    if damage in ("flip", "truncate", "remove"):
        assert "__0_1.distcp" in str(raised.value)
    assert raised.value.failures.keys() == {0}
    assert not target["model"]["fc.weight"].any() and target["step"] == 0  # nothing was changed
    if damage == "flip":
        with pytest.raises(CheckpointException, match="__0_1.distcp"):
            checkpoint.verify(directory)


def test_pieces_go_out_block_by_block_with_each_piece_hashed_whole(tmp_path, monkeypatch):
    monkeypatch.setattr(_storage, "WRITE_BLOCK", 1000)
    monkeypatch.setattr(_storage, "FLUSH_BLOCK", 3000)
    started = []
    monkeypatch.setattr(_storage, "_start_writeback", lambda fd, offset, length: started.append((offset, length)))
    rng = np.random.default_rng(0)
    pieces = [rng.standard_normal(n).astype(np.float32) for n in (2600, 0, 7, 1000)]  # blocks, none, part of one
    got = _storage.write_pieces(tmp_path / "f", pieces)
    raw = (tmp_path / "f").read_bytes()
    assert raw == b"".join(p.tobytes() for p in pieces) and got["size"] == len(raw)
    assert got["pieces"] == [_storage.checksum(p.tobytes()) for p in pieces]
    assert got["checksum"] == _storage.checksum(raw)
    # the kernel is asked to start writing each range of FLUSH_BLOCK bytes or more as it is written
    assert started[0][0] == 0 and all(a + n == b for (a, n), (b, _) in zip(started, started[1:]))
    assert all(n >= 3000 for _, n in started) and sum(n for _, n in started) > len(raw) - 3000
    started.clear()
    _storage.write_pieces(tmp_path / "g", pieces, fsync=False)
    assert not started and (tmp_path / "g").read_bytes() == raw


def test_a_save_that_fails_while_writing_leaves_the_previous_checkpoint(tmp_path, monkeypatch):
    directory = tmp_path / "c"
    checkpoint.save(state(), directory, group=G)
    monkeypatch.setattr(_storage, "WRITE_BLOCK", 16)
    written = []

    def failing(fd, block, offset):
        if len(written) == 3:
            raise OSError(28, "No space left on device")
        written.append(offset)
        return os.pwrite(fd, block, offset)

    monkeypatch.setattr(_storage, "_pwrite_all", failing)
    changed = state()
    changed["model"]["fc.weight"] += 1
    with pytest.raises(CheckpointException, match="rank 0: writing .*__0_2.distcp.*No space left"):
        checkpoint.save(changed, directory, group=G)
    monkeypatch.undo()
    assert checkpoint.verify(directory)["generation"] == 1  # the previous checkpoint, whole, checksums checked
    target = blank()
    checkpoint.load(target, directory, group=G)
    assert_loaded(target)


class TwoRanks(OneRank):
    """Rank 0 of two ranks that hold the same (replicated) state."""

    size = 2

    def allgather_object(self, obj, name=None):
        return [pickle.loads(pickle.dumps(obj)) for _ in range(2)]


def test_async_save_copies_only_the_pieces_this_rank_writes(tmp_path):
    values = {f"w{i}": np.full(4 + i, float(i)) for i in range(6)}
    job = _save._Save(values, tmp_path / "c", TwoRanks(), stage=True)
    mine = job.writes[0]
    assert 0 < len(mine) < 6 and set(job.pieces) == set(mine)  # the other rank writes (and copies) the rest
    for chunk, piece in job.pieces.items():
        assert piece.payload is not values[chunk[0]] and np.array_equal(piece.payload, values[chunk[0]])
    job.release()
    assert all(piece.payload is None for piece in job.pieces.values())


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="a nice value per thread is Linux's")
def test_async_save_writes_from_a_thread_at_the_lowest_priority(tmp_path, monkeypatch):
    seen = []
    write_pieces = _storage.write_pieces

    def observed(*args, **kwargs):
        seen.append((threading.current_thread() is threading.main_thread(),
                     os.getpriority(os.PRIO_PROCESS, threading.get_native_id())))
        return write_pieces(*args, **kwargs)

    monkeypatch.setattr(_storage, "write_pieces", observed)
    caller = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    checkpoint.async_save(state(), tmp_path / "c", group=G).wait(60)
    assert seen == [(False, _save.WRITER_NICE)] and _save.WRITER_NICE == 19
    assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == caller  # the caller's thread untouched


def test_an_async_save_whose_copy_fails_fails_its_future_and_keeps_the_previous_checkpoint(tmp_path, monkeypatch):
    checkpoint.save(state(), tmp_path / "c", group=G)

    def unreachable(array):
        raise RuntimeError("device lost")

    monkeypatch.setattr(_save, "to_numpy", unreachable)
    future = checkpoint.async_save(state(), tmp_path / "c", group=G)
    with pytest.raises(CheckpointException, match="rank 0: copying the arrays of .*__0_2.distcp: .*device lost"):
        future.wait(60)
    assert checkpoint.verify(tmp_path / "c")["generation"] == 1


def test_mismatched_templates_are_refused_naming_the_key(tmp_path):
    checkpoint.save(state(), tmp_path / "c", group=G)
    for template, message in [({"model": {"fc.weight": np.zeros((4, 3), np.float32)}}, "float32[4, 3]"),
                              ({"model": {"fc.weight": np.zeros((3, 4))}}, "float64[3, 4]"),
                              ({"step": np.zeros(1)}, "'step' does not match the checkpoint"),
                              ({"absent": 1}, "Missing key in checkpoint state_dict: absent")]:
        with pytest.raises(CheckpointException, match="does not match|Missing key") as raised:
            checkpoint.load(template, tmp_path / "c", group=G)
        assert message in str(raised.value) and ".metadata" in str(raised.value)
    with pytest.raises(CheckpointException, match="no such directory"):
        checkpoint.load({}, tmp_path / "nowhere", group=G)


def test_flattening_refuses_ambiguous_keys_and_calls_statefuls(tmp_path):
    with pytest.raises(CheckpointException, match="same key 'a.b'"):
        checkpoint.save({"a.b": 1, "a": {"b": 2}}, tmp_path / "c", group=G)
    with pytest.raises(CheckpointException, match="keys must be strings or integers"):
        checkpoint.save({(1, 2): 1}, tmp_path / "c", group=G)

    class Counter:
        def __init__(self):
            self.n = 5

        def state_dict(self):
            return {"n": self.n, "table": np.arange(3)}

        def load_state_dict(self, sd):
            self.n = sd["n"] * 10

    checkpoint.save({"counter": Counter()}, tmp_path / "s", group=G)
    fresh = Counter()
    fresh.n = 0
    box = {"counter": fresh}
    checkpoint.load(box, tmp_path / "s", group=G)
    assert box["counter"] is fresh and fresh.n == 50


def test_sharded_blocks_load_as_other_blocks(tmp_path):
    whole = np.arange(20.0).reshape(10, 2)
    checkpoint.save({"w": ShardedArray(whole, (10, 2), (0, 0))}, tmp_path / "c", group=G)
    block = ShardedArray(np.zeros((3, 2)), (10, 2), (4, 0))
    checkpoint.load({"w": block}, tmp_path / "c", group=G)
    assert np.array_equal(block.local, whole[4:7])
    slot = checkpoint.ShardedSlot((10, 2), (8, 0), (2, 2))
    target = {"w_state": slot}
    checkpoint.save({"w_state": {"m": ShardedArray(whole, (10, 2), (0, 0)), "step": 1}}, tmp_path / "d", group=G)
    checkpoint.load(target, tmp_path / "d", group=G)
    assert isinstance(slot["m"], ShardedArray) and np.array_equal(slot["m"].local, whole[8:10])
    assert slot["step"] == 1


def describe(fqn, kind, shape=None, offsets=None, sizes=None, nbytes=8, dtype="float64"):
    return (fqn, (fqn,), kind, dtype, shape, offsets, sizes, nbytes)


def test_plan_writes_a_replicated_piece_once_on_the_least_loaded_rank():
    ranks = [[describe("big", "array", (4,), (0,), (4,), 32), describe("own0", "sharded", (2,), (0,), (1,), 8)],
             [describe("big", "array", (4,), (0,), (4,), 32), describe("own0", "sharded", (2,), (1,), (1,), 8),
              describe("extra", "sharded", (1,), (0,), (1,), 100)]]
    items, writes, holders = _plan.global_plan(ranks)
    assert writes == [[("big", (0,), (4,)), ("own0", (0,), (1,))], [("extra", (0,), (1,)), ("own0", (1,), (1,))]]
    assert holders["big", (0,), (4,)] == [0, 1] and items["own0"]["shape"] == [2]


@pytest.mark.parametrize("ranks,message", [
    ([[describe("x", "array", (4,), (0,), (4,))], [describe("x", "array", (5,), (0,), (5,))]], "disagree on 'x'"),
    ([[describe("x", "sharded", (4,), (0,), (3,))], [describe("x", "sharded", (4,), (2,), (2,))]], "overlap"),
    ([[describe("x", "sharded", (4,), (0,), (1,))], [describe("x", "sharded", (4,), (2,), (2,))]], "cover 3 of"),
    ([[describe("x", "object", nbytes=3)], [describe("x", "array", (4,), (0,), (4,))]], "an object"),
])
def test_plan_refuses_state_dicts_that_cannot_be_a_checkpoint(ranks, message):
    with pytest.raises(CheckpointException, match=message):
        _plan.global_plan(ranks)


def test_async_save_completes_in_the_background(tmp_path):
    values = state()
    future = checkpoint.async_save(values, tmp_path / "c", group=G)
    values["model"]["fc.weight"][...] = -1  # the copy was taken before async_save returned
    metadata = future.wait(60)
    assert metadata["generation"] == 1 and not [p for p in os.listdir(tmp_path / "c") if p.startswith(".result")]
    target = blank()
    checkpoint.load(target, tmp_path / "c", group=G)
    assert_loaded(target)
    with pytest.raises(CheckpointException, match="rank 0: .*pickle"):
        checkpoint.async_save({"f": lambda: 1}, tmp_path / "d", group=G)


def test_distributed_sampler_resumes_after_the_indices_handed_out():
    sampler = DistributedSampler(20, num_replicas=2, rank=1, shuffle=True, seed=4)
    sampler.set_epoch(1)
    batches = sampler.batches(3)
    first = [next(batches), next(batches)]
    saved = sampler.state_dict()
    assert saved["consumed"] == 6 and saved["epoch"] == 1
    resumed = DistributedSampler(20, num_replicas=2, rank=1, shuffle=True, seed=4)
    resumed.load_state_dict(saved)
    resumed.set_epoch(1)  # the same epoch: the position stays
    rest = list(resumed.batches(3))
    assert np.array_equal(np.concatenate(first + rest), sampler.indices())
    resumed.set_epoch(2)
    assert resumed.consumed == 0
    with pytest.raises(ValueError, match="ElasticSampler"):
        DistributedSampler(20, num_replicas=4, rank=1, seed=4).load_state_dict(saved)


def test_elastic_sampler_applies_every_sample_once_across_a_shrink():
    n, batch = 50, 3
    seen = []
    samplers = [ElasticSampler(n, shuffle=True, seed=9, num_replicas=4, rank=r) for r in range(4)]
    steps = list(zip(*[s.batches(batch) for s in samplers]))
    for index, step in enumerate(steps[:2]):
        seen += [i for b in step for i in b.tolist()]
        for s in samplers:
            s.record_batch(index, batch)
    committed = samplers[0].state_dict()
    # the world shrinks to 2 ranks: the rest of the epoch is split between them
    survivors = [ElasticSampler(n, shuffle=True, seed=9, num_replicas=2, rank=r) for r in range(2)]
    for s in survivors:
        s.load_state_dict(committed)
    counts = [len(list(s.batches(batch))) for s in survivors]
    assert counts[0] == counts[1]  # the ranks step together
    for step in zip(*[s.batches(batch) for s in survivors]):
        seen += [i for b in step for i in b.tolist()]
    assert sorted(seen) == list(range(n))


def test_rng_state_round_trip(tmp_path):
    import random

    from distlab.nn.init import default_generator

    np.random.seed(3)
    random.seed(3)
    checkpoint.save({"rng": checkpoint.RNGState(group=G)}, tmp_path / "c", group=G)
    expected = (np.random.rand(), random.random(), default_generator().random())
    np.random.rand(5), random.random(), default_generator().random(4)
    checkpoint.load({"rng": checkpoint.RNGState(group=G)}, tmp_path / "c", group=G)
    assert (np.random.rand(), random.random(), default_generator().random()) == expected


def test_object_state_commits_and_restores(tmp_path, monkeypatch):
    monkeypatch.delenv("DISTLAB_RUN_DIR", raising=False)
    with pytest.raises(CheckpointException, match="no place for commits"):
        elastic.ObjectState(group=G, epoch=0).commit()
    state = elastic.ObjectState(checkpoint_dir=tmp_path, group=G, epoch=0, batch=0)
    assert state.restore() is False
    state.epoch, state.batch = 2, 5
    state.commit()
    state.epoch, state.batch = 9, 9
    assert state.restore() is True and (state.epoch, state.batch) == (2, 5)
    calls = []
    state.register_reset_callbacks([lambda: calls.append(state.epoch)])

    @elastic.run
    def train(s):
        return s.epoch

    assert train(state) == 2 and calls == [2]  # resumed from the commit: the reset callbacks ran
    assert elastic.recovery_for(RuntimeError("x")) is None  # no in-process recovery: the launcher restarts


def _model_state(tmp_path, **options):
    import distlab
    from distlab import nn, optim

    distlab.manual_seed(5)
    model = nn.Linear(4, 3)
    opt = optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    sampler = ElasticSampler(20, shuffle=True, seed=2, num_replicas=1, rank=0)
    state = elastic.ModelState(model, opt, sampler=sampler, group=G, steps=0, losses=[], **options)
    return state, model, opt, sampler


def _train_step(state, model, opt, sampler) -> None:
    import distlab

    opt.zero_grad()
    (model(distlab.tensor(np.random.rand(2, 4).astype(np.float32))) ** 2).sum().backward()
    opt.step()
    state.steps += 1
    state.losses.append(state.steps)
    sampler.record_batch(state.steps, 2)


def test_a_commit_is_kept_in_memory_and_restored_bit_for_bit(tmp_path):
    # What the survivors of a failure roll back to in process: the parameters, the optimizer's momentum, the
    # counters, the sampler's position and the generators, as they were at the commit; the copy stays intact for
    # a second rollback (the restored objects do not share its arrays).
    state, model, opt, sampler = _model_state(tmp_path, checkpoint_dir=tmp_path)
    for _ in range(2):
        _train_step(state, model, opt, sampler)
    state.commit()
    committed = (pickle.dumps(checkpoint.get_state_dict(model, opt)), state.steps, list(state.losses),
                 sampler.state_dict(), np.random.rand())
    for attempt in range(2):
        for _ in range(3):
            _train_step(state, model, opt, sampler)
        import shutil

        assert (tmp_path / "commit").exists() == (attempt == 0)
        shutil.rmtree(tmp_path / "commit", ignore_errors=True)  # gone: the restore must come from memory
        assert state.restore() is True
        got = (pickle.dumps(checkpoint.get_state_dict(model, opt)), state.steps, list(state.losses),
               sampler.state_dict(), np.random.rand())
        assert got == committed, attempt


def test_under_fault_tolerance_a_commit_with_no_place_stays_in_memory(tmp_path, monkeypatch):
    monkeypatch.delenv("DISTLAB_RUN_DIR", raising=False)
    monkeypatch.setenv("DISTLAB_FAULT_TOLERANCE", "1")
    state = elastic.ObjectState(group=G, epoch=1, batch=2)
    state.commit()
    state.epoch, state.batch = 5, 6
    assert state.restore() is True and (state.epoch, state.batch) == (1, 2)
    assert not state.has_commit() and list(tmp_path.iterdir()) == []


def test_only_a_failed_process_is_claimed_by_the_shrink_recovery(monkeypatch):
    from distlab.comm import ulfm
    from distlab.errors import ProcessFailedError

    failure = ProcessFailedError("allreduce failed", failed_ranks=[2], group_ranks=[2], group="world",
                                 op="allreduce", revoked=False, error_class=75)
    try:
        try:
            raise failure
        except ProcessFailedError as exc:
            raise RuntimeError("a DDP bucket failed") from exc
    except RuntimeError as wrapped:
        assert ulfm.process_failure(wrapped, None) is failure  # found behind the error the step raised
    assert ulfm.process_failure(RuntimeError("a bug"), None) is None
    monkeypatch.delenv("DISTLAB_FAULT_TOLERANCE", raising=False)
    assert elastic.recovery_for(failure) is None  # without fault tolerance: the launcher restarts
    monkeypatch.setenv("DISTLAB_FAULT_TOLERANCE", "1")
    assert isinstance(elastic.recovery_for(failure), elastic.ShrinkRecovery)
    assert elastic.recovery_for(RuntimeError("a bug")) is None


def test_elastic_train_refuses_a_state_without_a_sampler_and_a_bad_commit_interval(tmp_path):
    state, *_ = _model_state(tmp_path, checkpoint_dir=tmp_path, epoch=0, batch=0)
    with pytest.raises(ValueError, match="commit_every must be >= 1, got 0"):
        elastic.train(state, lambda ddp, indices: None, epochs=1, batch_size=2, commit_every=0)
    state.sampler = None
    with pytest.raises(ValueError, match="needs a ModelState with a sampler"):
        elastic.train(state, lambda ddp, indices: None, epochs=1, batch_size=2)
    assert state.commits == 0


def test_elastic_train_runs_each_sample_once_and_commits(tmp_path):
    state, model, opt, sampler = _model_state(tmp_path, checkpoint_dir=tmp_path, epoch=0, batch=0)
    seen = []
    elastic.train(state, lambda ddp, indices: seen.extend(indices.tolist()), epochs=2, batch_size=3,
                  commit_every=2)
    assert sorted(seen) == sorted(list(range(20)) * 2) and state.epoch == 2 and state.batch == 0
    assert state.commits == 2 * (7 // 2) + 2  # every second batch of the 7 per epoch, and each epoch's end
