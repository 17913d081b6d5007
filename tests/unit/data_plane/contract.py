"""Backend-agnostic contract suite for `DataPlaneClient`.

Each `check_*` takes a factory `make_client(storage_capacity=...) -> DataPlaneClient` and exercises one rule with
real data. A backend's test module runs them all:

    @pytest.mark.parametrize("check", CONTRACT_CHECKS, ids=lambda c: c.__name__)
    def test_contract(check): check(my_factory)

Checks use fresh uuid partition ids, so backends whose store outlives a client (a named Ray actor) are fine;
`hosted_store_fixtures` gives such a backend's module its owner and per-check attached clients.
"""

from __future__ import annotations

import importlib
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import torch

from relayrl.config import DataPlaneConfig
from relayrl.data_plane.codec import Column
from relayrl.data_plane.interfaces import (
    CapacityExceededError,
    ClaimTimeoutError,
    DataPlaneClient,
    DataPlaneClosedError,
    FieldNotWrittenError,
    KVBatchMeta,
    MissingKeysError,
    SchemaMismatchError,
    UnknownFieldError,
    UnknownPartitionError,
    UnknownTaskError,
)
from tests.unit.data_plane.contract_checkpoint import CHECKPOINT_CHECKS

ClientFactory = Callable[..., DataPlaneClient]
FIELDS = ["input_ids", "token_mask", "logprobs", "logprobs_bf16", "reward", "grid", "prev_logprobs"]


def hosted_store_fixtures(backend_module: str, cfg: DataPlaneConfig) -> tuple[Any, Any]:
    """`owner` and `make_client` fixtures for a backend whose store lives in a named Ray actor.

    One store serves the whole module (starting one costs seconds to tens of seconds on a 2-core box); each
    check's client attaches to it after a `reset`, which gives the check an empty store with the capacity it
    asked for. The backend module's `build_client(cfg, bootstrap=...)` builds both sides."""

    def build(bootstrap: bool) -> Any:
        return importlib.import_module(backend_module).build_client(cfg, bootstrap=bootstrap)

    @pytest.fixture(scope="module", name="owner")
    def owner(ray_cluster: None) -> Iterator[Any]:
        client = build(True)
        try:
            yield client
        finally:
            client.close()

    @pytest.fixture(name="make_client")
    def make_client(owner: Any) -> ClientFactory:
        def make(storage_capacity: int = 10_000) -> DataPlaneClient:
            owner.reset(storage_capacity)
            client: DataPlaneClient = build(False)
            return client

        return make

    return owner, make_client


@contextmanager
def _client(make: ClientFactory, **kw: int) -> Iterator[DataPlaneClient]:
    client = make(**kw)
    try:
        yield client
    finally:
        client.close()


def _pid() -> str:
    return f"p-{uuid.uuid4().hex[:10]}"


def _register(client: DataPlaneClient, n: int = 4, tasks: tuple[str, ...] = ("train",)) -> str:
    pid = _pid()
    client.register_partition(pid, FIELDS, n, list(tasks))
    return pid


def _batch(n: int, seed: int = 0) -> tuple[list[str], dict[str, Column | torch.Tensor], torch.Tensor]:
    """Keys and one of each kind: jagged int64/bool/float32/bf16, dense float32 [N], dense int64 [N, 2, 3]."""
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(1, 9, (n,), generator=g)  # [N]
    t = int(lens.sum())
    fields: dict[str, Column | torch.Tensor] = {
        "input_ids": Column(torch.randint(0, 50_000, (t,), generator=g), lens),
        "token_mask": Column(torch.rand(t, generator=g) > 0.5, lens),
        "logprobs": Column(-torch.rand(t, generator=g) * 5, lens),
        "logprobs_bf16": Column((-torch.rand(t, generator=g) * 5).to(torch.bfloat16), lens),
        "reward": torch.randn(n, generator=g),
        "grid": torch.randint(-9, 9, (n, 2, 3), generator=g),
    }
    return [f"u{seed}_{i // 2}_g{i % 2}" for i in range(n)], fields, lens


def _rows(col: Column) -> list[torch.Tensor]:
    return [col.row(i) for i in range(col.num_rows)]


def _assert_same_rows(got: Column, want: Column | torch.Tensor, order: list[int]) -> None:
    want_col = want if isinstance(want, Column) else Column(want)
    assert got.dtype == want_col.dtype and got.is_jagged == want_col.is_jagged
    assert got.num_rows == len(order)
    for i, j in enumerate(order):
        assert torch.equal(got.row(i), want_col.row(j)), f"row {i} differs from source row {j}"


# ---------------------------------------------------------------------------------------------------- round trips
def check_round_trip_bit_exact(make: ClientFactory) -> None:
    with _client(make) as c:
        pid = _register(c, 6)
        keys, fields, _ = _batch(6)
        receipt = c.put_samples(keys, pid, fields)
        assert isinstance(receipt, KVBatchMeta) and receipt.keys == keys and receipt.fields == list(fields)
        got = c.get_samples(keys, pid, list(fields))
        assert list(got) == list(fields)
        for name, want in fields.items():
            _assert_same_rows(got[name], want, list(range(6)))
        assert got["logprobs_bf16"].dtype == torch.bfloat16 and got["grid"].trailing_shape == (2, 3)


def check_rows_follow_requested_order(make: ClientFactory) -> None:
    with _client(make) as c:
        pid = _register(c, 6)
        keys, fields, _ = _batch(6, seed=1)
        c.put_samples(keys, pid, fields)
        order = [5, 0, 3, 1]
        got = c.get_samples([keys[i] for i in order], pid, ["input_ids", "reward"])
        _assert_same_rows(got["input_ids"], fields["input_ids"], order)
        _assert_same_rows(got["reward"], fields["reward"], order)


def check_rows_from_several_puts(make: ClientFactory) -> None:
    with _client(make) as c:
        pid = _register(c, 8)
        k1, f1, _ = _batch(4, seed=2)
        k2, f2, _ = _batch(4, seed=3)
        c.put_samples(k1, pid, f1)
        c.put_samples(k2, pid, f2)
        mixed = [k2[1], k1[3], k2[0], k1[0]]
        got = c.get_samples(mixed, pid, ["logprobs", "grid"])
        lp1, lp2 = f1["logprobs"], f2["logprobs"]
        assert isinstance(lp1, Column) and isinstance(lp2, Column)
        want = [lp2.row(1), lp1.row(3), lp2.row(0), lp1.row(0)]
        assert all(torch.equal(a, b) for a, b in zip(_rows(got["logprobs"]), want))
        g1, g2 = torch.as_tensor(f1["grid"]), torch.as_tensor(f2["grid"])
        assert torch.equal(got["grid"].values, torch.stack([g2[1], g1[3], g2[0], g1[0]]))


def check_write_back_adds_a_column(make: ClientFactory) -> None:
    with _client(make) as c:
        pid = _register(c, 4)
        keys, fields, lens = _batch(4, seed=4)
        c.put_samples(keys, pid, fields)
        sub = [keys[2], keys[0]]
        sub_lens = lens[[2, 0]]
        prev = Column(torch.arange(int(sub_lens.sum()), dtype=torch.float32), sub_lens)
        c.put_samples(sub, pid, {"prev_logprobs": prev})
        got = c.get_samples(sub, pid, ["prev_logprobs", "input_ids"])
        assert torch.equal(got["prev_logprobs"].values, prev.values)
        _assert_same_rows(got["input_ids"], fields["input_ids"], [2, 0])
        with pytest.raises(FieldNotWrittenError) as e:
            c.get_samples(keys, pid, ["prev_logprobs"])
        assert sorted(e.value.missing) == sorted([keys[1], keys[3]])


def check_overwrite_replaces_only_named_keys(make: ClientFactory) -> None:
    with _client(make) as c:
        pid = _register(c, 4)
        keys = ["a", "b", "c", "d"]
        c.put_samples(keys, pid, {"reward": torch.tensor([1.0, 2.0, 3.0, 4.0])})
        c.put_samples(["c", "a"], pid, {"reward": torch.tensor([30.0, 10.0])})
        assert c.get_samples(keys, pid, ["reward"])["reward"].values.tolist() == [10.0, 2.0, 30.0, 4.0]


def check_results_are_copies(make: ClientFactory) -> None:
    with _client(make) as c:
        pid = _register(c, 2)
        src = torch.tensor([1.5, 2.5])
        c.put_samples(["a", "b"], pid, {"reward": src})
        src.fill_(0.0)  # mutating the input after the put must not reach the store
        got = c.get_samples(["a", "b"], pid, ["reward"])["reward"].values
        got.fill_(-1.0)  # nor must mutating a result
        assert c.get_samples(["a", "b"], pid, ["reward"])["reward"].values.tolist() == [1.5, 2.5]


def check_empty_get_keeps_schema(make: ClientFactory) -> None:
    with _client(make) as c:
        pid = _register(c, 2)
        keys, fields, _ = _batch(2, seed=5)
        c.put_samples(keys, pid, fields)
        got = c.get_samples([], pid, ["logprobs_bf16", "grid"])
        assert got["logprobs_bf16"].num_rows == 0 and got["logprobs_bf16"].dtype == torch.bfloat16
        assert got["grid"].num_rows == 0 and got["grid"].trailing_shape == (2, 3)


# ---------------------------------------------------------------------------------------------------- strictness
def check_missing_keys_raise_naming_them(make: ClientFactory) -> None:
    with _client(make) as c:
        pid = _register(c, 2)
        c.put_samples(["a", "b"], pid, {"reward": torch.tensor([1.0, 2.0])})
        with pytest.raises(KeyError) as e:
            c.get_samples(["a", "zz", "b", "yy"], pid, ["reward"])
        assert isinstance(e.value, MissingKeysError) and e.value.missing == ["zz", "yy"]
        assert "zz" in str(e.value) and "yy" in str(e.value)


def check_unknown_and_unwritten_fields_raise(make: ClientFactory) -> None:
    with _client(make) as c:
        pid = _register(c, 2)
        c.put_samples(["a", "b"], pid, {"reward": torch.tensor([1.0, 2.0])})
        with pytest.raises(UnknownFieldError, match="rewrd"):
            c.get_samples(["a"], pid, ["rewrd"])
        with pytest.raises(FieldNotWrittenError, match="logprobs"):
            c.get_samples(["a"], pid, ["logprobs"])
        with pytest.raises(UnknownFieldError, match="typo_field"):
            c.put_samples(["a"], pid, {"typo_field": torch.tensor([1.0])})
        with pytest.raises(UnknownPartitionError):
            c.get_samples(["a"], "no-such-partition", ["reward"])
        with pytest.raises(UnknownPartitionError):
            c.put_samples(["a"], "no-such-partition", {"reward": torch.tensor([1.0])})


def check_schema_changes_raise_never_cast(make: ClientFactory) -> None:
    with _client(make) as c:
        pid = _register(c, 4)
        c.put_samples(["a", "b"], pid, {"reward": torch.tensor([1.0, 2.0]), "grid": torch.zeros(2, 2, 3)})
        c.put_samples(["a"], pid, {"logprobs": Column(torch.zeros(3), torch.tensor([3]))})
        bad: list[dict[str, Column | torch.Tensor]] = [
            {"reward": torch.tensor([1.0, 2.0], dtype=torch.float64)},  # dtype
            {"grid": torch.zeros(2, 3, 2)},  # trailing shape
            {"reward": Column(torch.zeros(2), torch.tensor([1, 1]))},  # dense -> jagged
            {"logprobs": torch.zeros(2, 5)},  # jagged -> dense
        ]
        for fields in bad:
            with pytest.raises(SchemaMismatchError, match="first written"):
                c.put_samples(["c", "d"], pid, fields)
        assert c.get_samples(["a", "b"], pid, ["reward"])["reward"].dtype == torch.float32


def check_failed_put_changes_nothing(make: ClientFactory) -> None:
    with _client(make) as c:
        pid = _register(c, 4)
        c.put_samples(["a"], pid, {"reward": torch.tensor([1.0])})
        with pytest.raises(SchemaMismatchError):  # the second field is bad: the first must not land either
            c.put_samples(["a", "new"], pid, {"grid": torch.zeros(2, 2, 3), "reward": torch.tensor([1, 2])})
        with pytest.raises(MissingKeysError):
            c.get_samples(["new"], pid, ["reward"])
        with pytest.raises(FieldNotWrittenError):
            c.get_samples(["a"], pid, ["grid"])
        assert c.get_samples(["a"], pid, ["reward"])["reward"].values.tolist() == [1.0]


def check_bad_put_shapes_raise(make: ClientFactory) -> None:
    with _client(make) as c:
        pid = _register(c, 4)
        with pytest.raises(ValueError, match="rows"):
            c.put_samples(["a", "b"], pid, {"reward": torch.zeros(3)})
        with pytest.raises(ValueError, match="duplicate"):
            c.put_samples(["a", "a"], pid, {"reward": torch.zeros(2)})
        with pytest.raises(ValueError, match="tags"):
            c.put_samples(["a", "b"], pid, {"reward": torch.zeros(2)}, tags=[{}])
        with pytest.raises(TypeError, match="non-tensor|tensor"):
            c.put_samples(["a"], pid, {"reward": ["hello"]})  # type: ignore[dict-item]


def check_keys_must_be_strings(make: ClientFactory) -> None:
    with _client(make) as c:
        pid = _register(c, 2)
        with pytest.raises(TypeError, match="strings"):
            c.put_samples([1, 2], pid, {"reward": torch.zeros(2)})  # type: ignore[list-item]


def check_capacity_is_enforced(make: ClientFactory) -> None:
    with _client(make, storage_capacity=4) as c:
        pid = _register(c, 8)
        c.put_samples(["a", "b", "c"], pid, {"reward": torch.zeros(3)})
        with pytest.raises(CapacityExceededError, match="storage_capacity"):
            c.put_samples(["d", "e"], pid, {"reward": torch.ones(2)})
        with pytest.raises(MissingKeysError):
            c.get_samples(["d"], pid, ["reward"])
        c.put_samples(["a", "b", "c", "d"], pid, {"reward": torch.ones(4)})  # overwrites need no new room
        assert c.clear_samples(["a", "b"], pid) == 2
        c.put_samples(["x", "y"], pid, {"reward": torch.ones(2)})


# ---------------------------------------------------------------------------------------------------- clear, lifecycle
def check_clear_counts_and_keeps_partition(make: ClientFactory) -> None:
    with _client(make) as c:
        pid = _register(c, 4)
        c.put_samples(["a", "b", "c"], pid, {"reward": torch.tensor([1.0, 2.0, 3.0])})
        assert c.clear_samples(["b", "nope"], pid) == 1
        with pytest.raises(MissingKeysError):
            c.get_samples(["b"], pid, ["reward"])
        assert c.get_samples(["c", "a"], pid, ["reward"])["reward"].values.tolist() == [3.0, 1.0]
        assert c.clear_samples(None, pid) == 2
        assert c.clear_samples(None, pid) == 0
        c.put_samples(["a"], pid, {"reward": torch.tensor([9.0])})  # still registered, schema kept
        assert c.get_samples(["a"], pid, ["reward"])["reward"].values.tolist() == [9.0]
        with pytest.raises(SchemaMismatchError):
            c.put_samples(["b"], pid, {"reward": torch.tensor([1])})


def check_partitions_are_independent(make: ClientFactory) -> None:
    with _client(make) as c:
        p1, p2 = _register(c, 2), _register(c, 2)
        c.put_samples(["k"], p1, {"reward": torch.tensor([1.0])})
        c.put_samples(["k"], p2, {"reward": torch.tensor([2.0])})
        assert c.clear_samples(None, p1) == 1
        assert c.get_samples(["k"], p2, ["reward"])["reward"].values.tolist() == [2.0]


def check_reregister_guards_data(make: ClientFactory) -> None:
    with _client(make) as c:
        pid = _register(c, 2)
        c.put_samples(["a"], pid, {"reward": torch.tensor([1.0])})
        with pytest.raises(ValueError, match="clear"):
            c.register_partition(pid, ["reward"], 2, ["train"])
        c.clear_samples(None, pid)
        c.register_partition(pid, ["other"], 4, ["t2"])
        c.put_samples(["a"], pid, {"other": torch.tensor([1])})
        with pytest.raises(UnknownFieldError):
            c.put_samples(["a"], pid, {"reward": torch.tensor([1.0])})


def check_drop_partition_forgets_only_an_empty_one(make: ClientFactory) -> None:
    with _client(make) as c:
        pid, other = _register(c, 2), _register(c, 2)
        c.put_samples(["a"], pid, {"reward": torch.tensor([1.0])})
        c.put_samples(["a"], other, {"reward": torch.tensor([2.0])})
        with pytest.raises(ValueError, match="still holds 1 samples"):
            c.drop_partition(pid)
        assert c.get_samples(["a"], pid, ["reward"])["reward"].values.tolist() == [1.0]  # refused: nothing lost
        assert c.clear_samples(None, pid) == 1
        assert c.drop_partition(pid) is True
        assert c.drop_partition(pid) is False  # no longer registered
        assert pid not in c.bytes_held()
        with pytest.raises(UnknownPartitionError):
            c.put_samples(["b"], pid, {"reward": torch.tensor([1.0])})
        c.register_partition(pid, ["reward"], 1, ["train"])  # the name can be declared afresh
        c.put_samples(["b"], pid, {"reward": torch.tensor([3.0])})
        assert c.get_samples(["a"], other, ["reward"])["reward"].values.tolist() == [2.0]


def check_close_is_idempotent_and_final(make: ClientFactory) -> None:
    c = make()
    pid = _register(c, 1)
    c.close()
    c.close()
    with pytest.raises(DataPlaneClosedError):
        c.put_samples(["a"], pid, {"reward": torch.tensor([1.0])})


# ---------------------------------------------------------------------------------------------------- task-mediated
def check_claim_meta_cursor_and_status(make: ClientFactory) -> None:
    with _client(make) as c:
        pid = _register(c, 5, tasks=("prev_lp", "train"))
        keys, fields, lens = _batch(5, seed=6)
        c.put_samples(keys, pid, fields, tags=[{"std": float(i)} for i in range(5)])
        assert not c.check_consumption_status(pid, ["prev_lp"])
        m1 = c.claim_meta(pid, "prev_lp", ["input_ids", "reward"], batch_size=3, timeout_s=5)
        assert m1.keys == keys[:3] and m1.task_name == "prev_lp" and m1.fields == ["input_ids", "reward"]
        assert m1.sequence_lengths == lens[:3].tolist()
        assert [t["std"] for t in m1.tags or []] == [0.0, 1.0, 2.0]
        m2 = c.claim_meta(pid, "prev_lp", ["input_ids"], batch_size=3, timeout_s=5)  # the 2-sample tail
        assert m2.keys == keys[3:]
        assert c.check_consumption_status(pid, ["prev_lp"]) and not c.check_consumption_status(pid, ["train"])
        _assert_same_rows(c.get_data(m2)["input_ids"], fields["input_ids"], [3, 4])
        with pytest.raises(UnknownTaskError, match="task"):
            c.claim_meta(pid, "trian", ["input_ids"], batch_size=1, blocking=False)


def check_claim_meta_waits_for_required_fields(make: ClientFactory) -> None:
    with _client(make) as c:
        pid = _register(c, 4)
        c.put_samples(["a", "b", "c", "d"], pid, {"reward": torch.zeros(4)})
        c.put_samples(["b", "d"], pid, {"grid": torch.zeros(2, 2, 3, dtype=torch.int64)})
        m = c.claim_meta(pid, "train", ["reward", "grid"], batch_size=4, blocking=False)
        assert m.keys == ["b", "d"]
        start = time.monotonic()
        with pytest.raises(ClaimTimeoutError):
            c.claim_meta(pid, "train", ["reward", "grid"], batch_size=2, timeout_s=0.2)
        assert time.monotonic() - start < 5.0

        def produce() -> None:
            time.sleep(0.2)
            c.put_samples(["a", "c"], pid, {"grid": torch.ones(2, 2, 3, dtype=torch.int64)})

        t = threading.Thread(target=produce)
        t.start()
        m2 = c.claim_meta(pid, "train", ["reward", "grid"], batch_size=2, timeout_s=10)
        t.join()
        assert m2.keys == ["a", "c"]
        assert c.check_consumption_status(pid, ["train"])


def check_get_data_needs_fields(make: ClientFactory) -> None:
    with _client(make) as c:
        pid = _register(c, 2)
        c.put_samples(["a", "b"], pid, {"reward": torch.tensor([1.0, 2.0])})
        with pytest.raises(ValueError, match="fields"):
            c.get_data(KVBatchMeta(pid, ["a"]))
        assert c.get_data(KVBatchMeta(pid, ["b", "a"]), ["reward"])["reward"].values.tolist() == [2.0, 1.0]


def check_concurrent_puts_and_gets(make: ClientFactory) -> None:
    with _client(make) as c:
        pid = _register(c, 64)
        errors: list[BaseException] = []

        def worker(w: int) -> None:
            try:
                for step in range(4):
                    keys = [f"w{w}_s{step}_{i}" for i in range(4)]
                    vals = torch.arange(4, dtype=torch.float32) + 100 * w + 10 * step
                    c.put_samples(keys, pid, {"reward": vals})
                    assert torch.equal(c.get_samples(keys, pid, ["reward"])["reward"].values, vals)
            except BaseException as e:  # surfaced below
                errors.append(e)

        threads = [threading.Thread(target=worker, args=(w,)) for w in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert not errors, errors
        assert c.clear_samples(None, pid) == 64


CONTRACT_CHECKS: list[Callable[[ClientFactory], None]] = [
    check_round_trip_bit_exact,
    check_rows_follow_requested_order,
    check_rows_from_several_puts,
    check_write_back_adds_a_column,
    check_overwrite_replaces_only_named_keys,
    check_results_are_copies,
    check_empty_get_keeps_schema,
    check_missing_keys_raise_naming_them,
    check_unknown_and_unwritten_fields_raise,
    check_schema_changes_raise_never_cast,
    check_failed_put_changes_nothing,
    check_bad_put_shapes_raise,
    check_keys_must_be_strings,
    check_capacity_is_enforced,
    check_clear_counts_and_keeps_partition,
    check_partitions_are_independent,
    check_reregister_guards_data,
    check_drop_partition_forgets_only_an_empty_one,
    check_close_is_idempotent_and_final,
    check_claim_meta_cursor_and_status,
    check_claim_meta_waits_for_required_fields,
    check_get_data_needs_fields,
    check_concurrent_puts_and_gets,
    *CHECKPOINT_CHECKS,
]
